"""The recovery benchmark (`recover bench recovery`): what a fault costs each system, measured with real kills.

Contract:
- Kills are real: seeded fault plans SIGKILL a replica at a random phase of a
  random step (the fault-injection harness), several kills per run, runs repeated
  until `--kills` kills have been measured. The same seed gives the same kills.
  Each kill's step is drawn uniformly within its 5-step window (`--kill-placement
  random`, the default): against the baselines' checkpoint every 5 steps a kill lands
  anywhere in the period, not always where it loses the most; `fixed` puts every kill
  at its window's first step (how the results before this option were measured).
  With `--shard S` > 1 each replica is S ranks and a kill strikes one of them,
  drawn per kill (any rank dying takes the replica). torchft runs S and T > 1 as
  its fault-tolerant HSDP (baselines/torchft_group.py), and ckpt-restart and elastic
  with sharded DCP checkpoints (baselines/ckpt_worker.py, elastic_worker.py), so
  every system can be measured at the same 3 x S2.
- torchft's lighthouse: `--torchft-heartbeat-timeout-ms` and `--torchft-join-timeout-ms`
  set it for every torchft run of the bench (default: BaselineConfig's, 1 s each, as
  `recover train` sets it); the summary records both (`torchft_lighthouse`), and a
  setting other than the default is in the file names (recovery_torchft_s2_hb250_join250.json),
  so the 1 s and the 250 ms figures sit side by side.
- Per kill it records: the fault (step, phase, replica), the time from the kill
  to the next committed iteration and to the first one without the killed replica, the recovery overhead (the duration of the
  iteration that absorbed the fault minus the median failure-free iteration's
  duration in the same run), and the work lost (microbatches that had to be
  redone or were thrown away).
- In the same invocation it runs the system and `--system plain` failure-free,
  interleaved, and reports the failure-free iteration-time overhead as a ratio
  measured side by side (these machines are noisy: only same-run ratios count).
  plain runs the same layout where it runs it (core/config/layouts.py: today every
  layout recover runs), else one rank per replica; the summary's `plain_shard`,
  `plain_tp` and `plain_pp` say which (a summary without the last two: 1).
- Writes results/bench/recovery_<system>.json (summary) and
  recovery_<system>_kills.csv (one row per kill), and prints a table; with S > 1
  the names end in _s<S> (recovery_recover_s2.json), beside the S = 1 figures. Nothing here
  is asserted on: it is a measurement, not a test.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from recover.baselines.settings import BaselineConfig
from recover.core.config.train_config import TrainConfig
from recover.core.storage.results import read_jsonl, read_metrics
from recover.fault_injection.injector import attach_plan

from recover.core.config.replica_layout import ReplicaLayout
from ..run import run_training
from ..systems import runs_layout

KILL_PHASES = ("forward", "backward", "between_microbatches", "allreduce", "commit", "optimizer_step")
KILL_PLACEMENTS = ("random", "fixed")
KILL_WINDOW = 5
"""Steps per kill window: BaselineConfig's default checkpoint interval (ckpt_every), so a random
placement is uniform over the checkpoint period."""


def iteration_durations(metrics: list[dict]) -> dict[int, float]:
    """step -> seconds from the previous commit to this one (step 0 has none)."""
    return {b["step"]: b["wall_time"] - a["wall_time"] for a, b in zip(metrics, metrics[1:])}


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def kill_plan(rng: random.Random, replicas: int, kills: int, steps: int, first: int, gap: int,
              shard: int = 1, placement: str = "random") -> list[dict]:
    """`kills` crashes of distinct replicas at random phases, one per window of `gap` steps from
    `first`; `placement` "random": at a uniformly drawn step of its window, so that against a
    checkpoint every `gap` steps a kill lands anywhere in the checkpoint period (the lost work is
    the period's average, not its worst); "fixed": at the window's first step (the placement of
    results measured before it, which with checkpoints every `gap` steps is the worst one). With
    `shard` > 1 ranks per replica, each at a random rank of its replica."""
    if placement not in KILL_PLACEMENTS:
        raise ValueError(f"placement {placement!r}: choose from {', '.join(KILL_PLACEMENTS)}")
    victims = rng.sample(range(replicas), kills)
    faults = []
    for i, r in enumerate(victims):
        phase = rng.choice(KILL_PHASES)
        offset = rng.randrange(gap) if placement == "random" else 0
        f = {"kind": "crash", "replica": r, "step": first + i * gap + offset, "phase": phase}
        if phase == "between_microbatches":
            f["microbatch"] = 1
        if shard > 1:
            f["rank"] = rng.randrange(shard)
        faults.append(f)
    assert faults[-1]["step"] < steps - 2
    return faults


def _work_lost(event: dict | None) -> int | None:
    """Microbatches a fault cost, in whichever words the system's events use."""
    if event is None:
        return None
    if "redone" in event:  # recover: the dead replica's share, redone by survivors
        return len(event["redone"])
    for key in ("lost_microbatches", "work_lost_microbatches"):  # restart / shrink baselines
        if key in event:
            return int(event[key])
    return None


def measure_run(out: Path, warmup: int = 2) -> dict:
    """Per-kill figures of one finished run (its metrics, events and faults files).

    Per kill: `kill_to_next_commit_s` (to the first commit after the kill, whatever
    its step: for a restarting system that is a replayed step), `kill_to_progress_s`
    (to the commit of the step the kill interrupted: what the job really lost in
    time), `kill_to_regroup_s` (to the first commit without the killed replica among
    its members: the membership change done, whatever the system counts a step
    voted before the kill as; None if it never left, as under a restart with every
    replica), and `recovery_overhead_s`: the gap between the last commit before the
    kill and the commit of the interrupted step, minus the median failure-free
    iteration of the same run (for recover: the faulty iteration's duration minus
    the median one).
    """
    metrics = read_metrics(out / "metrics.jsonl")
    events = [e for e in read_jsonl(out / "events.jsonl") if e.get("kind") != "run_end"]
    fired = read_jsonl(out / "faults.jsonl")
    dur = iteration_durations(metrics)
    disturbed = {e["step"] for e in events if "step" in e} | {f["step"] for f in fired}
    disturbed |= {s + 1 for s in disturbed}  # a fault after a commit lands in the next step
    clean = [d for s, d in dur.items() if s >= warmup and s not in disturbed]
    base = statistics.median(clean) if clean else float("nan")
    kills = []
    for f in fired:
        kill = f["wall_time"]
        after = [m for m in metrics if m["wall_time"] > kill]
        before = [m for m in metrics if m["wall_time"] <= kill]
        nxt = after[0] if after else None
        progress = next((m for m in after if m["step"] >= f["step"]), None)
        regroup = next((m for m in after if f["replica"] not in m.get("members", [f["replica"]])), None)
        # the recovery or restart the system recorded for this fault
        ev = next((e for e in events if e.get("detected_at", -1) >= kill - 1e-3), None)
        gap = (progress["wall_time"] - before[-1]["wall_time"]) if progress and before else None
        kills.append({
            "replica": f["replica"], **({"rank": f["rank"]} if "rank" in f else {}), "fault_step": f["step"], "phase": f["phase"],
            "kill_to_next_commit_s": (nxt["wall_time"] - kill) if nxt else None,
            "kill_to_progress_s": (progress["wall_time"] - kill) if progress else None,
            "kill_to_regroup_s": (regroup["wall_time"] - kill) if regroup else None,
            "recovery_overhead_s": (gap - base) if gap is not None else None,
            "detection_s": (ev["detected_at"] - kill) if ev else None,
            "work_lost_microbatches": _work_lost(ev),
        })
    return {"kills": kills, "clean_iteration_s": base, "clean_iterations": clean}


def torchft_settings(args: argparse.Namespace) -> BaselineConfig | None:
    """The torchft runs' settings from the bench's flags (None: not torchft, the system's defaults)."""
    if args.system != "torchft":
        return None
    d = BaselineConfig()
    hb, join = getattr(args, "torchft_heartbeat_timeout_ms", None), getattr(args, "torchft_join_timeout_ms", None)
    return dataclasses.replace(d, torchft_heartbeat_timeout_ms=d.torchft_heartbeat_timeout_ms if hb is None else hb,
                               torchft_join_timeout_ms=d.torchft_join_timeout_ms if join is None else join)


def _settings_suffix(settings: BaselineConfig | None) -> str:
    """The file names' mark of a torchft lighthouse set otherwise than by default ('' if not)."""
    if settings is None:
        return ""
    d = BaselineConfig()
    hb, join = settings.torchft_heartbeat_timeout_ms, settings.torchft_join_timeout_ms
    if (hb, join) == (d.torchft_heartbeat_timeout_ms, d.torchft_join_timeout_ms):
        return ""
    return f"_hb{hb}_join{join}"


def _train(cfg: TrainConfig, plan: list[dict] | None, settings: BaselineConfig | None = None) -> Path:
    if plan is not None:
        p = Path(cfg.out).parent / (Path(cfg.out).name + "_plan.json")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({"faults": plan}))
        cfg.faults = str(p)
    fault_plan = attach_plan(cfg)
    summary = run_training(cfg, plan=fault_plan, settings=settings)
    if summary["status"] != "ok":
        raise RuntimeError(f"benchmark run {cfg.out} failed: {summary['reason']}")
    return Path(cfg.out)


def bench_recovery(args: argparse.Namespace) -> int:
    """Measure what `--kills` kills cost args.system (arguments already checked); write and print the figures."""
    rng = random.Random(args.seed)
    work = Path(args.work or tempfile.mkdtemp(prefix="recover-bench-"))
    shard = getattr(args, "shard", 1)
    tp, pp, schedule = getattr(args, "tp", 1), getattr(args, "pp", 1), getattr(args, "pp_schedule", "1f1b")
    base = dict(replicas=args.replicas, microbatches=args.microbatches, seed=args.seed, progress=False,
                heartbeat_timeout=args.heartbeat_timeout)
    inner = dict(tp=tp, pp=pp, pp_schedule=schedule)  # the system's layout beyond S
    # plain is the failure-free reference: at the same layout where it runs it, else one rank per replica
    same = runs_layout("plain", ReplicaLayout(shard=shard, tp=tp, pp=pp))
    shards = {args.system: shard, "plain": shard if same else 1}
    inners = {args.system: inner, "plain": inner if same else {}}
    settings = torchft_settings(args)  # None for any other system: its defaults
    per_run = min(args.replicas - 1, args.kills)
    gap = KILL_WINDOW
    placement = getattr(args, "kill_placement", "random")
    steps = 4 + per_run * gap + 3
    kills: list[dict] = []
    runs = 0
    t_start = time.time()
    while len(kills) < args.kills:
        n = min(per_run, args.kills - len(kills))
        plan = kill_plan(rng, args.replicas, n, steps, first=4, gap=gap, shard=shard * tp * pp, placement=placement)
        cfg = TrainConfig(system=args.system, steps=steps, out=str(work / f"faulty{runs}"), shard=shard, **inner,
                          **base)
        out = _train(cfg, plan, settings)
        m = measure_run(out)
        kills += m["kills"]
        runs += 1
        print(f"run {runs}: {len(kills)}/{args.kills} kills measured ({time.time() - t_start:.0f}s)", file=sys.stderr)

    # failure-free: the system and plain, interleaved, same config
    clean: dict[str, list[float]] = {args.system: [], "plain": []}
    for rep in range(args.repeats):
        for system in (args.system, "plain"):
            cfg = TrainConfig(system=system, steps=args.clean_steps, out=str(work / f"clean_{system}{rep}"),
                              shard=shards[system], **inners[system], **base)
            clean[system] += measure_run(_train(cfg, None, settings if system == args.system else None)
                                         )["clean_iterations"]
    med = {s: statistics.median(v) for s, v in clean.items()}

    def stat(key: str) -> dict:
        xs = [k[key] for k in kills if k[key] is not None]
        return {"p50": percentile(xs, 0.5), "p95": percentile(xs, 0.95), "max": max(xs) if xs else None, "n": len(xs)}

    summary = {
        "system": args.system, "replicas": args.replicas, "shard": shard, "tp": tp, "pp": pp,
        **({"pp_schedule": schedule} if pp > 1 else {}), "plain_shard": shards["plain"],
        "plain_tp": tp if same else 1, "plain_pp": pp if same else 1,
        "microbatches": args.microbatches, "seed": args.seed,
        **({"torchft_lighthouse": {"heartbeat_timeout_ms": settings.torchft_heartbeat_timeout_ms,
                                   "join_timeout_ms": settings.torchft_join_timeout_ms,
                                   "heartbeat_interval_ms": settings.torchft_heartbeat_ms}}
           if settings is not None else {}),
        "kills": len(kills), "runs": runs,
        "kill_placement": f"{placement}: one kill per {gap}-step window from step 4"
                          + (" at a uniformly drawn step of it" if placement == "random" else " at its first step"),
        "kill_steps": [k.get("fault_step") for k in kills],
        "recovery_overhead_s": stat("recovery_overhead_s"),
        "kill_to_next_commit_s": stat("kill_to_next_commit_s"),
        "kill_to_progress_s": stat("kill_to_progress_s"),
        "kill_to_regroup_s": stat("kill_to_regroup_s"),
        "detection_s": stat("detection_s"),
        "work_lost_microbatches": stat("work_lost_microbatches"),
        "failure_free_iteration_s": med,
        # (plain at another layout: no overhead to speak of)
        "failure_free_overhead_vs_plain": med[args.system] / med["plain"] - 1.0 if same else None,
        # kill -> next commit as a multiple of the same layout's failure-free iteration
        "kill_to_next_commit_over_iteration": (percentile([k["kill_to_next_commit_s"] for k in kills
                                                           if k["kill_to_next_commit_s"] is not None], 0.5)
                                               / med[args.system]),
        "command": " ".join(["recover", "bench", "recovery", *sys.argv[3:]]) if len(sys.argv) > 2 else "",
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    stem = (f"recovery_{args.system}" + (f"_s{shard}" if shard > 1 else "") + (f"_t{tp}" if tp > 1 else "")
            + (f"_p{pp}{schedule}" if pp > 1 else "") + _settings_suffix(settings))
    (outdir / f"{stem}.json").write_text(json.dumps(summary, indent=2))
    with open(outdir / f"{stem}_kills.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(kills[0]))
        w.writeheader()
        w.writerows(kills)
    print_table(summary)
    print(f"wrote {outdir / f'{stem}.json'} and {stem}_kills.csv")
    return 0


def print_table(s: dict) -> None:
    def row(name: str, d: dict, unit: str = "s") -> str:
        return f"  {name:<28} p50 {d['p50']:8.3f}{unit}  p95 {d['p95']:8.3f}{unit}  (n={d['n']})"

    lay = ReplicaLayout.from_dict(s)  # a summary written before tp and pp holds shard only
    layout = f" of {lay.ranks} ranks ({lay.describe()})" if lay.ranks > 1 else ""
    print(f"{s['system']}: {s['kills']} kills over {s['runs']} runs, {s['replicas']} replicas{layout}, "
          f"M={s['microbatches']}")
    print(row("recovery overhead", s["recovery_overhead_s"]))
    print(row("kill -> next commit", s["kill_to_next_commit_s"]))
    print(row("kill -> interrupted step done", s["kill_to_progress_s"]))
    if s.get("kill_to_regroup_s", {}).get("n"):  # (summaries before it: none)
        print(row("kill -> commit without it", s["kill_to_regroup_s"]))
    print(row("detection", s["detection_s"]))
    print(row("work lost (microbatches)", s["work_lost_microbatches"], ""))
    ff = s["failure_free_iteration_s"]
    # plain ran another layout (a summary from before plain ran tp and pp: no plain_tp, plain_pp)
    inner = (s.get("tp", 1), s.get("pp", 1)) != (s.get("plain_tp", 1), s.get("plain_pp", 1))
    plain = "plain" + (f" (shard {s['plain_shard']}{', no tp or pp' if inner else ''})"
                       if inner or s.get("plain_shard", 1) != s.get("shard", 1) else "")
    versus = ("(a different layout: not an overhead)" if inner
              else f"-> overhead {100 * s['failure_free_overhead_vs_plain']:+.1f}%")
    print(f"  failure-free iteration       {s['system']} {ff[s['system']] * 1e3:.1f} ms, {plain} {ff['plain'] * 1e3:.1f} ms "
          f"{versus}")
    if "kill_to_next_commit_over_iteration" in s:
        print(f"  kill -> next commit / iteration  {s['kill_to_next_commit_over_iteration']:.2f} (p50 over the "
              f"layout's own failure-free iteration)")
