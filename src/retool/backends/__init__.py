"""retool.backends"""
