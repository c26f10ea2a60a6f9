"""A real two-node Slurm cluster on this one machine, for the tests.

Contract:
- `SlurmCluster(folder).start()` stands up, all state under `folder`: munged (its own
  key and socket), MariaDB on a unix socket (--skip-networking), slurmdbd, slurmctld
  and two slurmd nodes, n1 and n2 (`slurmd -D -N n1|n2`), each in the foreground in
  a session of its own, started by PID. `stop()` cancels the jobs still queued, ends
  each daemon by its PID (SIGTERM, then SIGKILL), slurmd first, MariaDB and munged
  last, and reaps the job steps (slurmstepd) that were reparented to this process
  when it is a child subreaper.
- `env` is the environment a Slurm client needs to talk to it (SLURM_CONF; PATH as
  it was): give it to sbatch, sacct, scontrol (or to submitit, which calls them).
- `why_not()` says, in one line, why a cluster cannot be stood up here (the Slurm
  and MariaDB binaries missing, or not root), or None when it can.
- Why each daemon: slurmctld and slurmd are the cluster; slurmdbd and MariaDB
  because submitit polls `sacct` and nothing else (without accounting, every state
  is UNKNOWN and a cancelled job is waited on forever); munged for authentication.
- Nodes declare 4 CPUs each (SlurmdParameters=config_overrides), more than the two
  real cores, and the partition oversubscribes, so a test's job shape does not
  depend on this machine's core count.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

# Debian's packages (bookworm: Slurm 22.05) and the binaries the cluster starts from them.
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "slurmdbd", "mariadb-server", "munge")
BINARIES = ("slurmctld", "slurmd", "slurmdbd", "sbatch", "sacct", "scontrol", "mariadbd", "mariadb-install-db",
            "munged")
NODES = ("n1", "n2")
CPUS_PER_NODE = 4
PARTITION = "debug"
CLUSTER = "recover"
# sacct's states of a job that has not ended yet (its man page, JOB STATE CODES)
ACTIVE_JOB_STATES = frozenset({"PENDING", "RUNNING", "REQUEUED", "RESIZING", "COMPLETING", "SUSPENDED",
                               "CONFIGURING", "STAGE_OUT", "SIGNALING", "REQUEUE_HOLD", "REQUEUE_FED"})


def why_not() -> str | None:
    """One line saying why no cluster can be stood up here, or None when it can."""
    missing = [b for b in BINARIES if shutil.which(b, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing); as root, `make test` installs "
                f"{' '.join(PACKAGES)}")
    if os.geteuid() != 0:
        return "the test cluster's daemons run as root (slurmd starts jobs as their user); run the suite as root"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _which(name: str) -> str:
    path = shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
    assert path, name
    return path


class SlurmCluster:
    """The daemons of a two-node cluster, all state under one folder (see the module docstring)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.host = socket.gethostname()
        self.procs: dict[str, subprocess.Popen] = {}
        self.env: dict[str, str] = {}
        self.timings: dict[str, float] = {}

    # ---- paths ------------------------------------------------------------------------------
    def path(self, *parts: str) -> Path:
        return self.folder.joinpath(*parts)

    def log(self, daemon: str) -> Path:
        return self.path("log", f"{daemon}.log")

    # ---- start ------------------------------------------------------------------------------
    def start(self) -> "SlurmCluster":
        t0 = time.monotonic()
        for d in ("etc", "log", "run", "munge", "db", "state", "spool"):
            self.path(d).mkdir(parents=True, exist_ok=True)
        try:
            self._start_munge()
            self._start_mariadb()
            self._write_conf()
            self._start("slurmdbd", [_which("slurmdbd"), "-D"])
            self._wait(lambda: self._dbd_up(), "slurmdbd", 30)
            self._start("slurmctld", [_which("slurmctld"), "-D", "-i"])
            self._wait(lambda: self._run("scontrol", "ping").returncode == 0, "slurmctld", 30)
            for n in NODES:
                self._start(f"slurmd-{n}", [_which("slurmd"), "-D", "-N", n])
            self._wait(lambda: all(self.node_state(n) == "idle" for n in NODES), "slurmd n1, n2", 60)
        except BaseException:
            self.stop()
            raise
        self.timings["start_s"] = time.monotonic() - t0
        return self

    def _start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self.log(name), "ab")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=env or self.env, start_new_session=True, cwd=self.folder)
        log.close()

    def _wait(self, ready, what: str, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited ({p.returncode}) while waiting for {what}: "
                                       f"{self._tail(name)}")
            if ready():
                return
            time.sleep(0.1)
        raise RuntimeError(f"{what} not up within {timeout:.0f}s; logs in {self.path('log')}")

    def _tail(self, name: str) -> str:
        try:
            return " | ".join(self.log(name).read_text().strip().splitlines()[-5:])
        except OSError:
            return "(no log)"

    def _start_munge(self) -> None:
        key = self.path("munge", "munge.key")
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.munge_socket = self.path("munge", "munge.socket")
        self._start("munged", [_which("munged"), "-F", "--force", f"--socket={self.munge_socket}",
                               f"--key-file={key}", f"--pid-file={self.path('run', 'munged.pid')}",
                               f"--seed-file={self.path('munge', 'seed')}", f"--log-file={self.log('munged-own')}"],
                    env=dict(os.environ))
        self._wait(lambda: self.munge_socket.exists(), "munged", 20)

    def _start_mariadb(self) -> None:
        data = self.path("db", "data")
        self.db_socket = self.path("db", "mysqld.sock")
        t = time.monotonic()
        init = subprocess.run(
            [_which("mariadb-install-db"), "--no-defaults", f"--datadir={data}", "--user=root",
             "--auth-root-authentication-method=socket", "--skip-test-db"],
            capture_output=True, text=True, timeout=120)
        if init.returncode != 0:
            raise RuntimeError(f"mariadb-install-db failed: {init.stdout[-2000:]}{init.stderr[-2000:]}")
        self.timings["mariadb_install_s"] = time.monotonic() - t
        self._start("mariadbd", [_which("mariadbd"), "--no-defaults", f"--datadir={data}", "--user=root",
                                 f"--socket={self.db_socket}", "--skip-networking",
                                 f"--pid-file={self.path('run', 'mariadbd.pid')}",
                                 "--innodb-buffer-pool-size=32M", "--skip-log-bin"],
                    env=dict(os.environ))
        self._wait(lambda: self.db_socket.exists(), "mariadbd", 60)

    def _write_conf(self) -> None:
        etc = self.path("etc")
        self.ctld_port, self.dbd_port = _free_port(), _free_port()
        node_ports = [_free_port() for _ in NODES]
        munge = f"socket={self.munge_socket}"
        lines = [
            f"ClusterName={CLUSTER}",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={self.ctld_port}",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo={munge}",
            f"StateSaveLocation={self.path('state')}",
            f"SlurmdSpoolDir={self.path('spool')}/%n",
            f"SlurmctldPidFile={self.path('run', 'slurmctld.pid')}",
            f"SlurmdPidFile={self.path('run')}/slurmd-%n.pid",
            f"SlurmctldLogFile={self.log('slurmctld-own')}",
            f"SlurmdLogFile={self.path('log')}/slurmd-%n-own.log",
            "SlurmdParameters=config_overrides",  # nodes declare more CPUs than the machine has
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none", "SwitchType=switch/none",
            "AccountingStorageType=accounting_storage/slurmdbd", "AccountingStorageHost=127.0.0.1",
            f"AccountingStoragePort={self.dbd_port}", f"AccountingStoragePass={self.munge_socket}",
            "JobCompType=jobcomp/none",
            # a submitted or requeued job starts at once instead of at the next minute's pass
            "SchedulerParameters=batch_sched_delay=0,sched_interval=1",
            "SchedulerType=sched/backfill", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "KillWait=2",  # submitit's worker ignores SIGTERM: a cancelled job is killed after 2 s, not 30
            "ReturnToService=1", "SlurmdTimeout=30", "MessageTimeout=10", "InactiveLimit=0",
            "MinJobAge=300",
            "SlurmctldDebug=info", "SlurmdDebug=info",
        ]
        for n, port in zip(NODES, node_ports):
            lines.append(f"NodeName={n} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={port} "
                         f"CPUs={CPUS_PER_NODE} RealMemory=2000 State=UNKNOWN")
        lines.append(f"PartitionName={PARTITION} Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE "
                     "State=UP OverSubscribe=FORCE")
        (etc / "slurm.conf").write_text("\n".join(lines) + "\n")
        dbd = etc / "slurmdbd.conf"
        dbd.write_text("\n".join([
            "AuthType=auth/munge", f"AuthInfo={munge}", "DbdHost=localhost", "DbdAddr=127.0.0.1",
            f"DbdPort={self.dbd_port}", "SlurmUser=root", "StorageType=accounting_storage/mysql",
            "StorageHost=localhost", "StorageUser=root", "StorageLoc=slurm_acct_db",
            f"PidFile={self.path('run', 'slurmdbd.pid')}", f"LogFile={self.log('slurmdbd-own')}",
            "DebugLevel=info",
        ]) + "\n")
        dbd.chmod(0o600)
        self.env = {**os.environ, "SLURM_CONF": str(etc / "slurm.conf"), "MYSQL_UNIX_PORT": str(self.db_socket)}

    def _dbd_up(self) -> bool:
        return self._run("sacctmgr", "-n", "list", "cluster").returncode == 0

    # ---- use --------------------------------------------------------------------------------
    def _run(self, tool: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run([_which(tool), *args], capture_output=True, text=True, env=self.env, timeout=timeout)

    def scontrol(self, *args: str) -> str:
        p = self._run("scontrol", *args)
        if p.returncode != 0:
            raise RuntimeError(f"scontrol {' '.join(args)}: {p.stderr.strip()}")
        return p.stdout

    def node_state(self, node: str) -> str:
        """The node's state as sinfo prints it, lower case (idle, alloc, mix, down*, drain...)."""
        p = self._run("sinfo", "-h", "-n", node, "-o", "%T")
        return p.stdout.strip().lower() if p.returncode == 0 else ""

    def queue(self) -> list[str]:
        """Ids of the jobs still queued or running (squeue)."""
        p = self._run("squeue", "-h", "-o", "%i")
        return p.stdout.split()

    def cancel(self, job: str) -> None:
        self._run("scancel", job)

    def resume(self, node: str) -> None:
        """Bring a node set down back (a job held for requeue must have left it first: resuming a node too early gives 'Duplicate jobid' and a drained node)."""
        self.scontrol("update", f"nodename={node}", "state=resume")
        end = time.monotonic() + 30
        while self.node_state(node) != "idle" and time.monotonic() < end:
            time.sleep(0.2)

    def node_reason(self, node: str) -> str:
        """Why the node is down or drained, as whoever set it so wrote it (sinfo's reason)."""
        return self._run("sinfo", "-h", "-n", node, "-o", "%E").stdout.strip()

    def job_state(self, job: str) -> str:
        """The job's state by squeue (PENDING, RUNNING, ...; '' once it left the queue)."""
        return self._run("squeue", "-h", "-j", job, "-o", "%T").stdout.strip()

    def job_states(self, job: str) -> list[str]:
        """Every state sacct recorded for the job's allocation, oldest first (RESIZING when it lost a node)."""
        p = self._run("sacct", "-n", "-X", "-P", "-j", job, "-o", "State")
        return [line.split(" ")[0] for line in p.stdout.split("\n") if line.strip()]

    def final_job_states(self, job: str, timeout_s: float = 60) -> list[str]:
        """`job_states` once the last one is an end state; waits for it, up to `timeout_s`.

        submitit calls a job done as soon as its result file is written, which is before the
        batch script has returned and before slurmctld has told slurmdbd the job ended: for a
        moment after, sacct still says RUNNING (seen in CI). The states are returned as they
        stand at the timeout, so a job that never ends fails the caller's assertion, not this.
        """
        end = time.monotonic() + timeout_s
        states = self.job_states(job)
        while (not states or states[-1] in ACTIVE_JOB_STATES) and time.monotonic() < end:
            time.sleep(0.5)
            states = self.job_states(job)
        return states

    def restarts(self, job: str) -> int:
        """How many times Slurm requeued the job (scontrol's Restarts=N; -1 once it left slurmctld's memory)."""
        p = self._run("scontrol", "-o", "show", "job", job)
        found = [f for f in p.stdout.split() if f.startswith("Restarts=")]
        return int(found[0].split("=")[1]) if found else -1

    def job_nodes(self, job: str) -> str:
        """The nodes a job ran on, as sacct prints them (n[1-2])."""
        p = self._run("sacct", "-n", "-X", "-P", "-j", job, "-o", "NodeList")
        return p.stdout.strip().splitlines()[0] if p.stdout.strip() else ""

    # ---- stop -------------------------------------------------------------------------------
    def stop(self) -> None:
        # Jobs first, while slurmctld and the nodes are there to end them: a job step's
        # processes (slurmstepd and its tasks) are not the daemons' children.
        if self.env and self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            jobs = self.queue()
            if jobs:
                self._run("scancel", *jobs)
                end = time.monotonic() + 15
                while self.queue() and time.monotonic() < end:
                    time.sleep(0.2)
        order = [n for n in self.procs if n.startswith("slurmd-")] + ["slurmctld", "slurmdbd", "mariadbd", "munged"]
        t0 = time.monotonic()
        for name in order:
            p = self.procs.get(name)
            if p is None:
                continue
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self._reap_steps()
        self.timings["stop_s"] = time.monotonic() - t0

    def _reap_steps(self) -> None:
        # slurmstepd daemonizes: when this process is a child subreaper (the launcher makes
        # itself one, core/launch/forkserver.py, and tests run it in-process), the steps it ran are
        # reparented here and linger as zombies. Reap exactly those, by PID; SIGKILL any still
        # alive (their job is gone by now).
        me = os.getpid()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
            if comm != "slurmstepd" or int(rest[1]) != me:
                continue
            pid = int(entry.name)
            if rest[0] != "Z":
                os.kill(pid, signal.SIGKILL)
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
