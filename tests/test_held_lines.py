"""HeldLineWriter (core/storage/results.py): a file that cannot be written holds lines, never loses them.

No process: a fake file raises OSError(ENOSPC) for a while (and writes short, as a
disk filling mid-line does), then works. Every line reaches the file once, in order,
whole; the hold is bounded; a torn last line left by a killed writer is ended first.
"""
from __future__ import annotations

import errno
import json

from recover.core.storage.results import HeldLineWriter, read_metrics


class FlakyFile:
    """write(bytes) -> int that fails with ENOSPC while `full`, and writes at most `room`
    bytes before failing when `room` is set (a short write, then the error)."""

    def __init__(self):
        self.data = bytearray()
        self.full = False
        self.room: int | None = None
        self.calls = 0

    def write(self, b: bytes) -> int:
        self.calls += 1
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        if self.room is not None:
            if self.room == 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            n = min(self.room, len(b))
            self.room -= n
            self.data += b[:n]
            return n
        self.data += b
        return len(b)

    def close(self) -> None:
        pass

    def lines(self) -> list[dict]:
        text = self.data.decode()
        assert text == "" or text.endswith("\n"), "a line was left torn"
        return [json.loads(line) for line in text.splitlines()]


def test_lines_held_while_full_are_written_in_order_once_space_is_back(tmp_path):
    f = FlakyFile()
    w = HeldLineWriter(tmp_path / "metrics.jsonl", max_held=100, file=f)
    assert w.write({"step": 0}) and w.held == 0 and w.error is None
    f.full = True
    for s in range(1, 6):
        assert not w.write({"step": s})
    assert w.held == 5 and w.error.errno == errno.ENOSPC and w.failing_since is not None
    assert not w.flush() and w.held == 5  # a retry without space changes nothing
    assert [r["step"] for r in f.lines()] == [0]
    f.full = False
    assert w.write({"step": 6})  # the next write writes the held ones first
    assert w.held == 0 and w.error is None and w.failing_since is None
    assert [r["step"] for r in f.lines()] == list(range(7))


def test_a_short_write_is_continued_where_it_stopped_not_repeated(tmp_path):
    f = FlakyFile()
    w = HeldLineWriter(tmp_path / "m.jsonl", file=f)
    w.write({"step": 0, "pad": "x" * 50})
    f.room = 17  # the disk fills 17 bytes into the next line
    assert not w.write({"step": 1, "pad": "y" * 50})
    assert not w.write({"step": 2})
    assert len(f.data) > 0 and not f.data.endswith(b"\n")  # a torn last line, for now
    f.room = 5  # a little room: a few more bytes of it, then full again
    assert not w.flush()
    f.room = None
    assert w.flush()
    assert [r["step"] for r in f.lines()] == [0, 1, 2]
    assert f.lines()[1]["pad"] == "y" * 50


def test_past_the_bound_it_says_so_and_drops_nothing(tmp_path):
    f = FlakyFile()
    f.full = True
    w = HeldLineWriter(tmp_path / "m.jsonl", max_held=3, file=f)
    for s in range(3):
        w.write({"step": s})
    assert w.held == 3 and not w.over_bound
    w.write({"step": 3})
    assert w.held == 4 and w.over_bound  # the owner stops the run; nothing is dropped here
    f.full = False
    assert w.close()
    assert [r["step"] for r in f.lines()] == [0, 1, 2, 3]


def test_a_real_file_that_cannot_be_created_is_a_held_write(tmp_path):
    blocker = tmp_path / "run"
    blocker.write_text("a file where the run directory should be")
    w = HeldLineWriter(blocker / "metrics.jsonl")
    assert not w.write({"step": 0}) and w.held == 1 and isinstance(w.error, OSError)
    blocker.unlink()
    assert w.write({"step": 1}) and w.close()
    assert [r["step"] for r in read_metrics(blocker / "metrics.jsonl")] == [0, 1]


def test_a_torn_last_line_is_ended_before_the_next_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1, "lo')  # a writer killed mid-line
    w = HeldLineWriter(path)
    assert w.write({"step": 1}) and w.close()
    assert path.read_text() == '{"step": 0}\n{"step": 1, "lo\n{"step": 1}\n'
    assert [r["step"] for r in read_metrics(path)] == [0, 1]


# ---- the coordinator's use of it (core/coordinator/service.py): no process, no connection ----
def _service(tmp_path, full: FlakyFile, max_held: int = 3):
    import threading

    from recover.core.config.train_config import TrainConfig
    from recover.core.coordinator.service import CoordinatorService

    cfg = TrainConfig(system="recover", replicas=2, microbatches=4, steps=3, out=str(tmp_path))
    svc = CoordinatorService(cfg, "127.0.0.1", 0, threading.Event())
    svc.listener.close()
    svc.sel.close()
    svc.metrics = HeldLineWriter(tmp_path / "metrics.jsonl", max_held=max_held, file=full)
    return svc


def test_the_coordinator_says_it_once_goes_on_and_says_when_written_again(tmp_path, capsys):
    f = FlakyFile()
    svc = _service(tmp_path, f)
    f.full = True
    for s in range(3):
        svc._write(svc.metrics, {"step": s})
    svc._retry_held(svc.now())
    assert svc.result is None  # at the bound, not past it: the run goes on
    f.full = False
    svc._write(svc.metrics, {"step": 3})
    log = capsys.readouterr().err
    assert log.count("cannot write") == 1 and "No space left on device" in log and "the run goes on" in log
    assert log.count("is written again") == 1
    assert [r["step"] for r in f.lines()] == [0, 1, 2, 3]


def test_past_the_bound_the_coordinator_stops_the_run_with_exit_7(tmp_path):
    from recover.core.contract.worker_exit import EXIT_RUN_DIR_UNWRITABLE

    f = FlakyFile()
    f.full = True
    svc = _service(tmp_path, f)
    for s in range(4):
        svc._write(svc.metrics, {"step": s})
    svc._retry_held(svc.now())
    code, reason = svc.result
    assert code == EXIT_RUN_DIR_UNWRITABLE == 7
    assert "metrics.jsonl" in reason and "No space left on device" in reason and "4 lines" in reason


def test_a_run_that_ends_with_lines_held_exits_7_naming_them(tmp_path, capsys):
    f = FlakyFile()
    f.full = True
    svc = _service(tmp_path, f)
    svc._write(svc.metrics, {"step": 0})
    svc.result = (0, "all 3 steps committed")
    assert svc.serve() == 7
    log = capsys.readouterr().err
    assert "1 of " in log and "metrics.jsonl lost" in log and "Traceback" not in log
