"""The trainers that put the planes together: one replica's workload, the resilient
worker process (`--system recover`), the plain data-parallel reference, and the DCP
checkpoints of a replica's training state.
"""
