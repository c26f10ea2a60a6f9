"""One replica's side of the protocol: the public `Replica` API, the fault-tolerant
collectives, the control channel to the coordinator, the gradient accumulator and its
ledger (plain and exact), the fold loop, state transfer and the committed optimizer step.
It never imports the coordinator package.
"""
