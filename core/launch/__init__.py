"""How a job's processes start and end: the local launcher, the fork server, what a worker
reads at start-up (its command line, environment and hooks), and the end-of-job verdict.
"""
