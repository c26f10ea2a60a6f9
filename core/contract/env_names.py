"""The environment of a run's processes: every RECOVER_* name, once, with what it carries.

Contract: the launcher (`recover train`, `recover launch`, the Slurm task, the baselines'
launchers) sets these for the processes it starts; the processes read them by these
names only (`os.environ[env_names.STORE_ADDR]`), so a name is spelled in one place and a
reader and a writer cannot drift apart. Values are strings, as the environment holds
them; host:port values are parsed by `core.launch.startup.env_addr`.
"""
from __future__ import annotations

# ---- where the run is -------------------------------------------------------------------------
STORE_ADDR = "RECOVER_STORE_ADDR"  # host:port of the coordinator's c10d store (behind its guard)
CONTROL_ADDR = "RECOVER_CONTROL_ADDR"  # host:port of the coordinator's control service (or a lighthouse)
T0 = "RECOVER_T0"  # the run's start on the time.time() clock: every record's times count from it
JOIN_TOKEN = "RECOVER_JOIN_TOKEN"  # the run's random join token: a hello without it is refused

# ---- who this process is ----------------------------------------------------------------------
REPLICA = "RECOVER_REPLICA"  # this process's replica (TorchElastic's workers: their node)
REPLICAS = "RECOVER_REPLICAS"  # how many replicas the run has
LOCAL_RANK = "RECOVER_LOCAL_RANK"  # this process's rank within its replica (0: the leader)
RANKS_PER_REPLICA = "RECOVER_RANKS_PER_REPLICA"  # P x S x T: the processes of one replica
TP = "RECOVER_TP"  # tensor-parallel ranks per replica (`recover launch --tp`)
PP = "RECOVER_PP"  # pipeline stages per replica (`recover launch --pp`)
PP_SCHEDULE = "RECOVER_PP_SCHEDULE"  # afab | 1f1b
# the how-manieth process set of this replica's slot (0: the first; a replacement counts up), so a
# replacement's groups inside its replica never meet the keys its dead predecessor left in the store
INCARNATION = "RECOVER_INCARNATION"
WORKER_STARTED = "RECOVER_WORKER_STARTED"  # time.time() when the launcher started this process
WORKER_START = "RECOVER_WORKER_START"  # "fork": the launcher forks workers from its fork server

# ---- the deadlines a user's loop takes from its launcher (`recover launch`) -----------------
COLLECTIVE_TIMEOUT = "RECOVER_COLLECTIVE_TIMEOUT"  # seconds (--collective-timeout)
HEARTBEAT_INTERVAL = "RECOVER_HEARTBEAT_INTERVAL"  # seconds (--heartbeat-interval)
HEARTBEAT_TIMEOUT = "RECOVER_HEARTBEAT_TIMEOUT"  # seconds (--heartbeat-timeout)
COORDINATOR_TIMEOUT = "RECOVER_COORDINATOR_TIMEOUT"  # seconds of coordinator silence that make it gone
RECONNECT_TIMEOUT = "RECOVER_RECONNECT_TIMEOUT"  # seconds a worker keeps reaching a restarted coordinator
# "1": a launcher that restarts a dead coordinator supervises this worker, and ends the job (this
# process with it) once it restarts none: the worker keeps reaching the coordinator, with no bound of its own
COORDINATOR_SUPERVISED = "RECOVER_COORDINATOR_SUPERVISED"
REJOIN = "RECOVER_REJOIN"  # "0": a fenced replica exits instead of rejoining

# ---- the checkpoint-restart baseline's incarnations -------------------------------------------
MEMBERS = "RECOVER_MEMBERS"  # comma-separated replicas of this incarnation
ATTEMPT = "RECOVER_ATTEMPT"  # the incarnation's number (0 first)
