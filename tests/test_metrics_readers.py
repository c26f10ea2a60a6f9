"""Every reader of metrics.jsonl reads recover's compact line, not only the plain one.

recover's coordinator writes a step's members and ledgers run-length encoded
(`member_ranges`, `ledger_runs`, `ledger_rest`); `read_metrics` gives readers `members`,
`ledgers` and `folded` back. A reader that parses the lines itself and indexes `members`
breaks on the compact form: the demo did, and no test ran it. Here each reader runs over
a file of compact lines as the coordinator writes them, and `read_jsonl` refuses the file
outright, so a new raw reader fails the first time it runs. A last check reads the
source: no expression names metrics.jsonl and parses or reads a file raw. Pure: files in a temporary folder, no process.
"""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from recover.core.storage.results import pack_members, parse_metrics_line, read_jsonl, read_metrics

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "baselines", "experiments", "fault_injection", "paper_figs", "examples", "benchmarks", "tests")
M, STEPS = 8, 6


def compact_lines(out: Path) -> list[dict]:
    """A recover run's metrics.jsonl: 4 members, then 3 after replica 1 is lost at step 2,
    each survivor redoing part of its share (two ranges in its ledger)."""
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(STEPS):
        lo = step * M
        if step < 2:
            members = [0, 1, 2, 3]
            ledgers = {str(r): [[lo + 2 * r, lo + 2 * r + 2]] for r in members}
        else:  # replica 1's two ids, redone by 0 and 2
            members = [0, 2, 3]
            ledgers = {"0": [[lo, lo + 3], [lo + 4, lo + 5]], "2": [[lo + 3, lo + 4], [lo + 5, lo + 6]],
                       "3": [[lo + 6, lo + 8]]}
        lines.append({"step": step, "loss": 5.0 - 0.1 * step, "tokens": M * 64,
                      "microbatch_id_ranges": [[lo, lo + M]], **pack_members(members, ledgers),
                      "generation": 0 if step < 2 else 1, "recoveries": int(step == 2),
                      "wall_time": 1.0 + 0.5 * step, "lr": 1e-3})
    assert all("members" not in x and "ledgers" not in x for x in lines)  # the compact form, truly
    (out / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return lines


def plain_lines(out: Path) -> None:
    """The failure-free reference's lines: the plain form (`members`, no ledgers)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 5.0 - 0.1 * s, "tokens": M * 64,
                    "microbatch_id_ranges": [[s * M, (s + 1) * M]], "generation": 0,
                    "members": [0, 1, 2, 3], "wall_time": 1.0 + 0.5 * s, "lr": 1e-3}) + "\n"
        for s in range(STEPS)))


def test_read_jsonl_refuses_the_metrics_file(tmp_path):
    compact_lines(tmp_path)
    with pytest.raises(ValueError, match="read_metrics"):
        read_jsonl(tmp_path / "metrics.jsonl")
    assert [m["members"] for m in read_metrics(tmp_path / "metrics.jsonl")][-1] == [0, 2, 3]


def test_the_demo_table_reads_compact_lines(tmp_path, capsys):
    from recover.experiments.demo import print_trajectories

    compact_lines(tmp_path / "rec")
    plain_lines(tmp_path / "ref")
    events = [{"kind": "recovery", "step": 2, "detected_at": 3.02, "recovery_seconds": 0.05,
               "survivors": [0, 2, 3], "redone": [17, 18]}]
    fired = [{"replica": 1, "phase": "backward", "wall_time": 3.0}]
    same = print_trajectories(read_metrics(tmp_path / "ref" / "metrics.jsonl"),
                              read_metrics(tmp_path / "rec" / "metrics.jsonl"), events, fired, M)
    out = capsys.readouterr().out
    assert same is True
    assert "[0, 2, 3]  <- replica lost, recovered" in out
    assert f"every step of the faulty run folded exactly the same {M} microbatch ids: True" in out
    assert "replica 1 killed in backward; detected 20 ms after the kill" in out


def test_the_demo_says_false_when_a_step_folded_other_ids(tmp_path, capsys):
    from recover.experiments.demo import print_trajectories

    lines = compact_lines(tmp_path / "rec")
    plain_lines(tmp_path / "ref")
    lines[3]["ledger_rest"]["2"] = [[27, 28]]  # replica 2 reported one id fewer at step 3
    (tmp_path / "rec" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    same = print_trajectories(read_metrics(tmp_path / "ref" / "metrics.jsonl"),
                              read_metrics(tmp_path / "rec" / "metrics.jsonl"), [], [], M)
    assert same is False and "microbatch ids: False" in capsys.readouterr().out


def test_the_benchmarks_and_the_progress_bar_read_compact_lines(tmp_path):
    from recover.experiments.benches.exact_precision import _losses
    from recover.experiments.benches.iteration import _iteration_seconds
    from recover.experiments.progress import MetricsProgress

    lines = compact_lines(tmp_path)
    assert _iteration_seconds(tmp_path / "metrics.jsonl") == pytest.approx(0.5)
    assert _losses(tmp_path) == [x["loss"] for x in lines]
    bar = MetricsProgress(str(tmp_path), STEPS, enabled=False)
    bar.on_tick(0.0)
    assert bar.last is not None and bar.last["step"] == STEPS - 1 and bar.last["members"] == [0, 2, 3]
    assert parse_metrics_line(json.dumps(lines[0]))["folded"] == {str(r): 2 for r in range(4)}


def test_aggregation_reads_compact_lines(tmp_path):
    from recover.experiments.aggregate import load_run

    compact_lines(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"train": {
        "system": "recover", "seed": 0, "replicas": 4, "steps": STEPS}}))
    run = load_run(tmp_path)
    assert run is not None and [m["members"] for m in run.metrics][1:3] == [[0, 1, 2, 3], [0, 2, 3]]


RAW_READS = ("loads", "read_jsonl", "read_text", "open", "readlines")


def _raw_reads_of_metrics(tree: ast.AST, reads: tuple[str, ...] = RAW_READS):
    """Calls that read or parse a file raw where the file is named metrics.jsonl in the call
    itself, e.g. `(run / "metrics.jsonl").read_text()` or `open(out / "metrics.jsonl")`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in reads and any(isinstance(n, ast.Constant) and n.value == "metrics.jsonl"
                                         for part in (f, *node.args) for n in ast.walk(part)):
                yield node.lineno, name


def test_no_code_reads_metrics_jsonl_raw():
    offenders = set()
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path == ROOT / "core" / "storage" / "results.py":
                continue  # the contract's own reader
            if path == Path(__file__).resolve():
                continue  # this file writes and refuses raw lines on purpose
            # the tests write fixture files and compare files byte for byte: only a parse counts there
            reads = ("loads", "read_jsonl") if pkg == "tests" else RAW_READS
            for line, name in _raw_reads_of_metrics(ast.parse(path.read_text()), reads):
                offenders.add(f"{path.relative_to(ROOT)}:{line} reads metrics.jsonl with {name}")
    assert not offenders, "read metrics.jsonl with read_metrics:\n" + "\n".join(sorted(offenders))


def test_the_source_check_sees_a_raw_reader():
    raw = 'ls = [json.loads(x)["members"] for x in (run / "metrics.jsonl").read_text().splitlines()]'
    assert list(_raw_reads_of_metrics(ast.parse(raw)))
    assert not list(_raw_reads_of_metrics(ast.parse('ms = read_metrics(run / "metrics.jsonl")')))
