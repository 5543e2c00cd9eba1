"""retool.sandbox"""
