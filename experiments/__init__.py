"""recover.experiments"""
