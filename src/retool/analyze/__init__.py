"""retool.analyze"""
