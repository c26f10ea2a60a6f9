"""recover.fault_injection"""
