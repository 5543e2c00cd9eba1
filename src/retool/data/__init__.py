"""retool.data"""
