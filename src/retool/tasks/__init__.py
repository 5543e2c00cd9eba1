"""retool.tasks"""
