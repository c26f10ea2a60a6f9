"""recover.baselines"""
