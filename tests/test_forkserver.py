"""The fork server keeps Popen's contract for `python -m` and `python script.py` workers
(core/launch/forkserver.py).

Real processes throughout: the child is a real fork, killed by its PID.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import pid_alive
from recover.core.launch.forkserver import ForkServer, forkable
from recover.core.launch.launcher import python_module_argv

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]

HERE = str(Path(__file__).parent)


def _env(**extra: str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": HERE, **extra}


def _report(log: Path, timeout: float = 30.0) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for line in log.read_text().splitlines() if log.exists() else []:
            if line.startswith("{"):
                return json.loads(line)
        time.sleep(0.02)
    raise AssertionError(f"no report in {log}: {log.read_text() if log.exists() else 'missing'}")


def test_a_forked_worker_has_its_own_pid_group_env_argv_and_exit_code(tmp_path):
    server = ForkServer.shared()
    log = tmp_path / "a.log"
    p = server.start(python_module_argv("forkserver_child", "exit", "7"), _env(PROBE="x"), str(log))
    assert p.wait(30) == 7
    r = _report(log)
    assert r["pid"] == p.pid and r["ppid"] == os.getpid()  # re-parented to us: we reap it
    assert r["pgid"] == p.pid != os.getpgid(0)  # a process group of its own
    assert r["argv"] == ["exit", "7"] and r["probe"] == "x" and r["n_env"] == 3  # exactly the env given
    assert r["torch_loaded"]  # the point: imported once, by the server


def test_a_signal_and_an_exception_read_as_they_do_with_popen(tmp_path):
    server = ForkServer.shared()
    p = server.start(python_module_argv("forkserver_child", "sleep", "60"), _env(), str(tmp_path / "k.log"))
    _report(tmp_path / "k.log")
    assert p.poll() is None
    os.kill(p.pid, signal.SIGKILL)
    assert p.wait(30) == -signal.SIGKILL
    q = server.start(python_module_argv("forkserver_child", "raise"), _env(), str(tmp_path / "r.log"))
    assert q.wait(30) == 1 and "RuntimeError: boom" in (tmp_path / "r.log").read_text()
    s = server.start(python_module_argv("forkserver_child", "sleep", "60"), _env(), str(tmp_path / "s.log"),
                     new_session=True)
    assert _report(tmp_path / "s.log")["sid"] == s.pid
    s.kill()
    assert s.wait(30) == -signal.SIGKILL


def test_a_worker_dies_with_its_launcher(tmp_path):
    # A launcher process of our own that forks a sleeper and is then SIGKILLed: the
    # sleeper must not outlive it (PR_SET_PDEATHSIG, set once it is the launcher's).
    script = tmp_path / "launcher.py"
    script.write_text(
        "import sys, time\n"
        "from recover.core.launch.forkserver import ForkServer\n"
        "from recover.core.launch.launcher import python_module_argv\n"
        f"p = ForkServer.shared().start(python_module_argv('forkserver_child', 'sleep', '120'), "
        f"{{'PYTHONPATH': {HERE!r}}}, {str(tmp_path / 'c.log')!r})\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    launcher = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(launcher.stdout.readline())
        _report(tmp_path / "c.log")
        launcher.kill()
        launcher.wait(30)
        end = time.monotonic() + 30
        # (dead, it may linger as a zombie of ours: this process is a subreaper too)
        while time.monotonic() < end:
            if not pid_alive(child):
                break
            time.sleep(0.05)
        else:
            os.kill(child, signal.SIGKILL)
            raise AssertionError("the forked worker outlived its launcher")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def test_a_forked_script_runs_as_main_with_its_folder_first_on_the_path(tmp_path):
    # A user's loop under `recover launch` is `python script.py`: forked, it must see what
    # a fresh interpreter would (__main__, its argv, its folder first on sys.path).
    folder = tmp_path / "loop"
    folder.mkdir()
    (folder / "sibling.py").write_text("VALUE = 'from the script folder'\n")
    (folder / "loop.py").write_text(
        "import json, os, sys\n"
        "import sibling\n"
        "print(json.dumps({'name': __name__, 'argv': sys.argv, 'path0': sys.path[0], 'pid': os.getpid(),\n"
        "                  'sibling': sibling.VALUE, 'torch_loaded': 'torch' in sys.modules}), flush=True)\n"
        "sys.exit(3)\n")
    argv = [sys.executable, str(folder / "loop.py"), "--steps", "2"]
    assert forkable(argv)
    log = tmp_path / "s.log"
    p = ForkServer.shared().start(argv, _env(), str(log))
    assert p.wait(30) == 3
    r = _report(log)
    assert r["name"] == "__main__" and r["pid"] == p.pid
    assert r["argv"] == [str(folder / "loop.py"), "--steps", "2"]
    assert r["path0"] == str(folder) and r["sibling"] == "from the script folder"
    assert r["torch_loaded"]


def test_a_launcher_forked_from_a_server_forks_its_own_server_and_its_workers_start_clean(tmp_path):
    # A launcher that was itself forked (the suite's CLIs are) has torch imported: its
    # server is then a fork of it, not a fresh interpreter. Its workers must not see what
    # the launcher set up: its signal handlers, its imports of this project's modules.
    script = tmp_path / "launcher.py"
    script.write_text(
        "import json, signal, sys\n"
        "import recover.experiments.cli  # the launcher's own imports\n"
        "from recover.core.launch import forkserver\n"
        "signal.signal(signal.SIGTERM, lambda *a: None)  # as a launcher's run() does\n"
        "signal.signal(signal.SIGWINCH, lambda *a: None)  # any other handler in Python: reset as exec would\n"
        "server = forkserver.ForkServer()\n"
        "kind = type(server._proc).__name__\n"
        f"p = server.start([sys.executable, '-m', 'forkserver_child', 'exit', '5'], {{'PYTHONPATH': {HERE!r}}}, "
        f"{str(tmp_path / 'w.log')!r})\n"
        "code = p.wait(60)\n"
        "server.close()\n"
        "print(json.dumps({'kind': kind, 'code': code, 'server_exit': server._proc.poll()}), flush=True)\n"
    )
    log = tmp_path / "l.log"
    launcher = ForkServer.shared().start([sys.executable, str(script)], _env(PYTHONPATH=os.pathsep.join(sys.path)),
                                         str(log))
    assert launcher.wait(90) == 0, log.read_text()
    r = _report(log)
    assert r == {"kind": "_SelfForkedServer", "code": 5, "server_exit": 0}, r
    w = _report(tmp_path / "w.log")
    assert w["torch_loaded"] and w["sigterm_default"] and w["argv"] == ["exit", "5"]
    assert w["caught"] == [], w["caught"]  # no handler of the launcher's survives into a worker
    assert w["recover_modules"] == [], w["recover_modules"]  # imported afresh by a worker, under its env


def test_only_this_interpreters_module_and_script_runs_are_forkable(tmp_path):
    assert forkable(python_module_argv("recover.core.training.plain", "--replica", "0"))
    assert not forkable(["/bin/sleep", "1"]) and not forkable([sys.executable, "script.py"])  # no such file
    (tmp_path / "s.py").write_text("")
    assert forkable([sys.executable, str(tmp_path / "s.py")])
    assert not forkable(["/usr/bin/python3", str(tmp_path / "s.py")])  # another interpreter
    assert not forkable([sys.executable, "-c", "print(1)"]) and not forkable([sys.executable, "-m"])
    with pytest.raises(ValueError, match="only"):
        ForkServer.start(None, ["/bin/true"], {}, "/dev/null")  # refused before any use of the server
