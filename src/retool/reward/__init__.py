"""retool.reward"""
