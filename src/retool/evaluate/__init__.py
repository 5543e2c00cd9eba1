"""retool.evaluate"""
