"""retool.protocol"""
