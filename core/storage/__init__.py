"""Where a run's files live: the results contract (metrics.jsonl and the rest) and the
checkpoint folder's layout. Torch-free, so that the CLI and the figures read them cheaply.
"""
