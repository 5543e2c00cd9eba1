"""retool.rollout"""
