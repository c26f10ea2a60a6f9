"""recover.core"""
