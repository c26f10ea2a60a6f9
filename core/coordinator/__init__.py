"""The coordinator: membership and commit as a pure state machine (`protocol`), the socket
service around it, the vote tally, the replicas' speeds, and its process entry point.
It never imports the worker package: both speak only through `recover.core.contract`.
"""
