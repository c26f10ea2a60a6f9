"""What Slurm says of a job: its state, and why it is pending.

Contract:
- `job_state(id)` is the job's state by sacct, or by squeue where sacct does not know it
  (not started yet, a cluster without accounting): "GONE" when neither knows it,
  "UNKNOWN" when a command failed or timed out. Each command is bounded (30 or 60 s).
- `SLURM_LIVE` lists the states in which a job may still run its tasks; any other is final.
- `pending_reason(id)` is squeue's reason for a pending job ('' on failure), and
  `NEVER_STARTS` those that no wait lifts.
Used by the run's tasks (experiments/launch_submitit.py) and task 0's replacer
(experiments/slurm_replacements.py), which must not import each other.
"""
from __future__ import annotations

import subprocess

# Slurm's states of a job that may still run its tasks (sacct); any other state is final.
SLURM_LIVE = ("PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SUSPENDED",
              "CONFIGURING", "COMPLETING", "SIGNALING", "STAGE_OUT", "PREEMPTED", "UNKNOWN", "")
# squeue's reasons for a pending job that waiting cannot lift: the request exceeds what the
# partition or the account allows, or names something that does not exist.
NEVER_STARTS = ("PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints", "InvalidAccount",
                "InvalidQOS", "QOSJobLimit", "AccountNotAllowed", "JobHeldAdmin", "DependencyNeverSatisfied")


def pending_reason(job_id: str) -> str:
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%r"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip()


def job_state(job_id: str) -> str:
    """The job's state by sacct ('' when sacct does not know it yet). Asked here, not through
    submitit's watcher: that one stops asking once it sees a state it does not know (RESIZING,
    after a node of a --no-kill job failed) and keeps that state for good."""
    try:
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "UNKNOWN"
    lines = out.stdout.split("\n") if out.returncode == 0 else []
    lines = [x.strip() for x in lines if x.strip()]
    if not lines:
        # Not in sacct (an array element not started yet, or a cluster without accounting,
        # where submitit would wait forever on a cancelled job): squeue -t all knows a job
        # while it is queued and for MinJobAge after it ended; unknown to both, it is gone.
        try:
            queued = subprocess.run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"], capture_output=True,
                                    text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return "UNKNOWN"
        if queued.returncode != 0 and "Invalid job id" not in queued.stderr:
            return "UNKNOWN"
        return queued.stdout.strip().split("\n")[-1] or "GONE"
    return lines[-1].split(" ")[0]  # "CANCELLED by 0": the state is its first word
