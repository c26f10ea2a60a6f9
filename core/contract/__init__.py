"""What the processes of a run agree on, and nothing else: torch-free, imports no other plane.

The control messages and their wire checks, id ranges, the quota policy (a pure function
every process could evaluate alike), non-finite reporting, the heartbeat rate, the exit
codes a worker ends with, and the join-token handshake of the rendezvous store. The
coordinator and the worker both rest on this package and never import each other.
"""
