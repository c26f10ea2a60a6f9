"""The workload's building blocks: the GPT model and the token streams with global ids.
"""
