"""How often workers beat and how long the coordinator waits: a heartbeat rate that stays flat in R.

The strategy, one rule per failure:
- A crash is seen by its connection closing: the kernel closes a dead process's
  sockets, the coordinator reads EOF within milliseconds, whatever the heartbeat
  interval (measured: `recover bench coordinator --service`). No heartbeat is needed.
- A freeze (SIGSTOP, a process stuck holding the GIL, a lost node) is seen by
  silence, and bounded by the collective deadline anyway: survivors waiting on a
  frozen peer fail their collective and report it. Heartbeats only make it sooner.
- So heartbeats get a budget: the coordinator takes at most `budget` of them per
  second from all workers together. With R replicas each beats every
  max(interval, R / budget) seconds, and silence counts as death after
  max(timeout, MISSED_BEATS such intervals). Up to budget x interval replicas
  (200 with the defaults) nothing changes; beyond, the coordinator's heartbeat
  load is flat in R and only a freeze's detection time grows, linearly.
- Any line a worker sends is a sign of life (the service stamps every read), so a
  worker skips a heartbeat when it sent something else within the interval: with
  steps shorter than the interval, votes are the heartbeats.
The coordinator names the interval in its answer to each hello (the "startup"
message), so one number, computed here once, governs both ends.
"""
from __future__ import annotations

MISSED_BEATS = 3  # intervals of silence before death, once the interval is stretched (the config's rule: > 2)


def heartbeat_plan(replicas: int, interval: float, timeout: float, budget: float) -> tuple[float, float]:
    """(seconds between one worker's heartbeats, seconds of silence that make it dead) for R replicas."""
    every = max(interval, replicas / budget)
    return every, max(timeout, MISSED_BEATS * every)
