"""retool.train"""
