"""Typed run configuration, its validation, and its CLI flags.

Contract:
- `TrainConfig` is the whole resolved configuration of one run; every field has a
  one-line doc (its `help`) and becomes a `--flag` of `recover train` by
  `add_dataclass_flags`, so the CLI and the config cannot drift apart.
- `TrainConfig.validate()` raises `ConfigError(flag, message)` for the first bad
  value, before any process starts; `str(error)` is one line naming the flag.
- `to_json`/`from_json` round-trip exactly: a worker process reads the very config
  the launcher resolved (DIR/config.json).
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from recover.core.storage.checkpoint_dir import CheckpointDir
from recover.core.config.errors import ConfigError
from recover.core.config.fields import doc_field as _f
from recover.core.config.layouts import refusal as layout_refusal
from recover.core.config.replica_layout import ReplicaLayout
from recover.core.contract.nonfinite import ON_NONFINITE
from recover.core.config.schedule import WarmupCosine
from recover.core.config.shapes import MODEL_CONFIGS, MODEL_SCHEDULES, GPTConfig, model_config

DTYPES = ("fp32", "bf16")
EXACT_SYSTEMS = ("plain", "recover", "ckpt-restart")  # the trainers that build their accumulator from the Workload


def _torch_is_a_gpu_build() -> bool:
    """False when the installed torch was built without CUDA or ROCm, read from its
    version.py without importing torch (seconds of CPU in a process that only
    launches others). Anything unexpected answers True: the caller then asks torch."""
    spec = importlib.util.find_spec("torch")  # finds the package; imports nothing
    if spec is None or not spec.submodule_search_locations:
        return True
    try:
        tree = ast.parse((Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text())
    except (OSError, SyntaxError):
        return True
    built_for = {}
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id in ("cuda", "hip") and isinstance(node.value, ast.Constant):
            built_for[target.id] = node.value.value
    return set(built_for) != {"cuda", "hip"} or any(v is not None for v in built_for.values())


@dataclass
class TrainConfig:
    """One training run, as `recover train` resolves it."""

    system: str = _f("plain", "training system: plain (failure-free reference), recover, or a baseline")
    model: str = _f("tiny", f"model size: {', '.join(MODEL_CONFIGS)}")
    replicas: int = _f(4, "data-parallel replicas R (the failure domain: --shard ranks each)")
    shard: int = _f(1, "ranks per replica S: FSDP2 shards the model over them (HSDP); 1 = plain data parallel. "
                       "recover and plain only; R x S worker processes in all. A replica of many ranks is healed rank to "
                       "rank: replaced (--replace-after) or woken from a false death, it rejoins")
    tp: int = _f(1, "tensor-parallel ranks T per replica: each block's heads and MLP width split over them (recover "
                    "and plain; must divide the heads and 4 x n_embd); a replica is --pp x --shard x --tp ranks, tp innermost")
    pp: int = _f(1, "pipeline stages P per replica: the model's blocks cut into P consecutive stages, one rank each "
                    "(recover and plain; at most the model's layers); the rank grid is (pp, shard, tp), pp outermost")
    pp_schedule: str = _f("1f1b", "pipeline schedule with --pp > 1: afab (all forwards, then all backwards: GPipe) "
                                  "or 1f1b (nanotron's names)")
    microbatches: int = _f(8, "microbatches M per iteration (the global batch), M >= R")
    steps: int = _f(20, "iterations (optimizer steps) to run")
    seed: int = _f(0, "seed for initial weights, data order and per-microbatch randomness")
    out: str = _f("runs/latest", "output directory for config.json, metrics.jsonl, summary.json, logs/")
    batch_size: int = _f(4, "sequences per microbatch")
    block_size: int = _f(0, "context length in tokens (0 = the model's)")
    vocab_size: int = _f(0, "vocabulary size (0 = the model's; raise it for .bin token files)")
    dropout: float = _f(0.0, "dropout probability")
    data: str = _f("", "training data: a text file, a uint16 .bin token file, or '' for the stdlib corpus")
    corpus_bytes: int = _f(4_000_000, "bytes of the built-in stdlib corpus to use")
    lr: float = _f(0.0, "peak learning rate after warm-up (0 = the model's default, see core/components/model.py)")
    min_lr: float = _f(-1.0, "floor the cosine decay reaches at the last step (-1 = the model's, scaled with --lr)")
    warmup_steps: int = _f(-1, "steps of linear warm-up (-1 = the model's fraction of --steps)")
    weight_decay: float = _f(0.1, "AdamW weight decay (applied to matrices and embeddings only)")
    dtype: str = _f("fp32", "forward/backward precision: fp32, or bf16 autocast (weights, gradients, reduction stay fp32)")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this (0 = off)")
    exact: bool = _f(False, "bit-identical trajectories: each microbatch's gradient summed as int64 fixed point "
                            "(order-free, core/worker/exact.py) and deterministic kernels; the same ids give the same "
                            "weights whatever replicas fold or die (plain, recover, ckpt-restart; plain and recover also at "
                            "--shard, --tp and --pp, bit for bit within one layout; with --pp each microbatch runs "
                            "through a schedule of its own, so the stages do not overlap)")
    exact_range: int = _f(12, "with --exact: a microbatch whose gradient elements are all below 2^this in magnitude "
                              "is summed at full resolution; up to 2^(this+30) in coarser wide sums (a spike); beyond, "
                              "it is reported as non-finite (--on-nonfinite), never wrapped")
    backend: str = _f("auto", "collective backend: auto (nccl on GPUs, else gloo), gloo, nccl")
    device: str = _f("auto", "device: auto (cuda if available), cpu, cuda")
    threads: int = _f(1, "torch intra-op threads per worker process")
    collective_timeout: float = _f(
        30.0, "seconds a collective may take before it counts as failed (catches hangs)"
    )
    heartbeat_interval: float = _f(0.1, "seconds between a worker's heartbeats to the coordinator")
    heartbeat_timeout: float = _f(
        3.0, "seconds without a heartbeat after which a worker is declared dead (catches hangs)"
    )
    heartbeat_budget: float = _f(
        2000.0, "recover: heartbeats per second the coordinator takes from all workers together; past "
        "budget x interval replicas the interval stretches to replicas / budget (core/contract/heartbeat.py)"
    )
    digest_every: int = _f(
        1, "recover: every this many steps each vote carries a weights digest; off the majority = fenced (0 = off)"
    )
    fence_after: int = _f(
        3, "recover: fence a replica implicated in this many consecutive failed generations (a broken link)"
    )
    max_failed_generations: int = _f(
        10, "recover: stop the run (exit 1) after this many consecutive generations fail without a commit"
    )
    replace_after: float = _f(
        -1.0, "seconds after a replica's loss before its replacement arrives. recover: the launcher then starts "
        "one in its slot, which joins at the next commit with the live state (-1 = never); ckpt-restart with "
        "--restart-mode replace: the restart waits this long for it (0 if not given)"
    )
    max_heal_attempts: int = _f(
        3, "recover: a newcomer whose state transfer failed this many times is refused (it exits, code 3; "
        "--replace-after then starts another process in its slot)"
    )
    min_replicas: int = _f(
        1, "recover: with fewer members at an iteration boundary, the next step waits (up to --startup-timeout) "
        "for replacements or woken replicas to join (the step in flight is finished by the survivors)"
    )
    rejoin: bool = _f(
        True, "recover: a replica declared dead that was only frozen or slow rejoins, with the live state, "
        "at the next commit (--no-rejoin: it exits, code 3)"
    )
    coordinator_timeout: float = _f(
        10.0, "recover: seconds of silence from the coordinator (it beats at least every second) after which the "
        "workers reconnect and the launcher kills and restarts it (a frozen coordinator)"
    )
    reconnect_timeout: float = _f(
        60.0, "recover: seconds a worker keeps trying to reach a restarted coordinator before it exits (code 4)"
    )
    on_nonfinite: str = _f(
        "stop", "recover: a step whose loss is not finite (NaN, inf): stop the run at once, naming the step, the "
        "replicas and the microbatch ids (exit 1), or skip the step (no optimizer step) and go on"
    )
    coordinator_restarts: int = _f(
        3, "recover: times the launcher restarts a coordinator killed by a signal or frozen; the new one rebuilds "
        "membership, step and generation from the workers' reports (0 = never)"
    )
    startup_timeout: float = _f(
        300.0, "seconds the coordinator waits for every replica's hello before generation 0 forms "
        "with those connected (the workers wait as long as it tells them)"
    )
    checkpoint_every: int = _f(
        0, "save a DCP checkpoint every K committed steps. recover: asynchronous, never by default (0; given "
        "on the command line it must be >= 1); ckpt-restart and elastic: blocking unless --checkpoint-async, "
        "every 5 by default (they restart from it)"
    )
    checkpoint_dir: str = _f("", "recover: where checkpoints are written ('' = DIR/checkpoints)")
    checkpoint_keep: int = _f(2, "complete checkpoints kept on disk, older ones deleted (recover, ckpt-restart, elastic)")
    checkpoint_failures: int = _f(
        3, "recover: checkpoint saves failed in a row (a full disk, a lost mount) after which the run stops, exit 1"
    )
    resume_from: str = _f("", "the complete checkpoint this run resumes from (set by --resume DIR)", cli=False)
    faults: str = _f("", "fault plan JSON file to inject (see docs/faults.md); '' = none")
    progress: bool = _f(True, "show a progress bar on the terminal")
    hooks: str = _f("", "module:function building worker hooks (set by the CLI; advanced)", cli=False)
    coordinator_hooks: str = _f("", "module:function building the coordinator's hooks (set by the CLI; advanced)",
                                cli=False)

    # ---- derived -------------------------------------------------------------
    def gpt_config(self) -> GPTConfig:
        overrides: dict[str, Any] = {"dropout": self.dropout}
        if self.block_size:
            overrides["block_size"] = self.block_size
        if self.vocab_size:
            overrides["vocab_size"] = self.vocab_size
        return model_config(self.model, **overrides)

    @property
    def ranks_per_replica(self) -> int:
        """Processes per replica: --pp x --shard x --tp."""
        return self.layout().ranks

    def layout(self) -> ReplicaLayout:
        """Each replica's rank grid (--shard, --tp, --pp)."""
        return ReplicaLayout(shard=self.shard, tp=self.tp, pp=self.pp)

    def lr_schedule(self) -> WarmupCosine:
        """The run's schedule: the model's defaults, with --lr/--min-lr/--warmup-steps applied."""
        d = MODEL_SCHEDULES[self.model]
        max_lr = self.lr if self.lr > 0 else d.max_lr
        min_lr = self.min_lr if self.min_lr >= 0 else d.min_lr * max_lr / d.max_lr
        warmup = self.warmup_steps if self.warmup_steps >= 0 else d.warmup_for(self.steps)
        return WarmupCosine(max_lr=max_lr, min_lr=min_lr, warmup_steps=warmup, decay_steps=self.steps - 1)

    def checkpoint_root(self) -> Path:
        """The directory checkpoints are written to and resumed from."""
        return Path(self.checkpoint_dir) if self.checkpoint_dir else Path(self.out) / "checkpoints"

    @property
    def start_step(self) -> int:
        """The first step this run trains: 0, or the step of the checkpoint it resumes from."""
        return CheckpointDir.step_of(self.resume_from) if self.resume_from else 0

    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if self.resolved_device() == "cuda" else "gloo"

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        if not _torch_is_a_gpu_build():  # a CPU wheel: no need to import torch to know
            return "cpu"
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    # ---- validation ------------------------------------------------------------
    def validate(self, systems: tuple[str, ...] | None = None, own_model: bool = False) -> None:
        """Raise ConfigError for the first bad value (before any process starts). `own_model`: the
        workers train a model of their own (`recover launch`), so --tp and --pp are not checked
        against --model's heads and layers (the user's loop checks its own)."""
        if systems is not None and self.system not in systems:
            raise ConfigError("--system", f"unknown system {self.system!r}; choose from {', '.join(systems)}")
        if self.model not in MODEL_CONFIGS:
            raise ConfigError("--model", f"unknown model {self.model!r}; choose from {', '.join(MODEL_CONFIGS)}")
        positive = ["replicas", "microbatches", "steps", "batch_size", "threads", "corpus_bytes", "fence_after",
                    "max_failed_generations", "checkpoint_keep", "checkpoint_failures", "max_heal_attempts"]
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(flag_name(name), f"must be >= 1, got {getattr(self, name)}")
        for name in ("shard", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ConfigError(flag_name(name), f"must be >= 1, got {getattr(self, name)}")
        # which system runs which layout: one table (core/config/layouts.py), one line per refusal
        if (refused := layout_refusal(self.system, self.replicas, self.shard, self.tp, self.pp)) is not None:
            raise refused
        # what the grid needs of the model and the batch: one set of rules (core/config/replica_layout.py);
        # a user's own loop (own_model) checks its own model's heads and layers
        g = None if own_model else self.gpt_config()  # (the model name is checked above)
        self.layout().check(self.pp_schedule, heads=g and g.n_head, mlp_width=g and 4 * g.n_embd,
                            layers=g and g.n_layer, batch_size=self.batch_size, model=f"--model {self.model}")
        if self.microbatches < self.replicas:
            raise ConfigError(
                "--microbatches",
                f"M={self.microbatches} is less than --replicas R={self.replicas}; every replica needs work",
            )
        for name in ["block_size", "vocab_size", "seed", "digest_every", "checkpoint_every"]:
            if getattr(self, name) < 0:
                raise ConfigError(flag_name(name), f"must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("--dropout", f"must be in [0, 1), got {self.dropout}")
        if self.lr < 0:
            raise ConfigError("--lr", f"must be > 0 (or 0 for the model's default), got {self.lr}")
        if (self.min_lr < 0 and self.min_lr != -1.0) or (self.min_lr >= 0 and self.min_lr > self.lr_schedule().max_lr):
            raise ConfigError("--min-lr", f"must be in [0, peak lr] (or -1 for the model's default), got {self.min_lr}")
        if self.warmup_steps < -1:
            raise ConfigError("--warmup-steps", f"must be >= 0 (or -1 for the model's default), got {self.warmup_steps}")
        if self.dtype not in DTYPES:
            raise ConfigError("--dtype", f"unknown dtype {self.dtype!r}; choose from {', '.join(DTYPES)}")
        if self.exact:
            if self.system not in EXACT_SYSTEMS:
                raise ConfigError("--exact", f"is for {', '.join(EXACT_SYSTEMS)}, not {self.system!r}")
            if self.ranks_per_replica > 1 and self.system not in ("plain", "recover"):
                # the baselines' loop reduces the wide sums over the job's group, not across a grid's positions
                raise ConfigError("--exact", f"at a replica of many ranks is for plain and recover, not {self.system!r}")
            shift = 62 - self.microbatches.bit_length() - self.exact_range  # core/exact.fixed_point_shift
            if not 1 <= shift <= 100:
                raise ConfigError("--exact-range", f"{self.exact_range} with M={self.microbatches} leaves a "
                                                   f"fixed-point shift of {shift}; it must be in [1, 100]")
        if self.weight_decay < 0 or self.grad_clip < 0:
            bad = "weight_decay" if self.weight_decay < 0 else "grad_clip"
            raise ConfigError(flag_name(bad), f"must be >= 0, got {getattr(self, bad)}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ConfigError("--backend", f"unknown backend {self.backend!r}; choose from auto, gloo, nccl")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError("--device", f"unknown device {self.device!r}; choose from auto, cpu, cuda")
        for name in ["collective_timeout", "heartbeat_interval", "heartbeat_timeout", "heartbeat_budget",
                     "startup_timeout", "coordinator_timeout", "reconnect_timeout"]:
            if getattr(self, name) <= 0:
                raise ConfigError(flag_name(name), f"must be > 0, got {getattr(self, name)}")
        if self.heartbeat_timeout <= 2 * self.heartbeat_interval:
            raise ConfigError("--heartbeat-timeout", "must exceed twice --heartbeat-interval")
        if self.on_nonfinite not in ON_NONFINITE:
            raise ConfigError("--on-nonfinite", f"unknown action {self.on_nonfinite!r}; choose from "
                              f"{', '.join(ON_NONFINITE)}")
        if self.coordinator_restarts < 0:
            raise ConfigError("--coordinator-restarts", f"must be >= 0 (0: never), got {self.coordinator_restarts}")
        if not 1 <= self.min_replicas <= self.replicas:
            raise ConfigError("--min-replicas", f"must be in [1, --replicas={self.replicas}], got {self.min_replicas}")
        if self.replace_after < 0 and self.replace_after != -1.0:
            raise ConfigError("--replace-after", f"must be >= 0 (or -1: never), got {self.replace_after}")
        if self.replace_after >= 0 and self.system not in ("recover", "ckpt-restart"):
            raise ConfigError("--replace-after", f"only recover and ckpt-restart (--restart-mode replace) take "
                                                 f"replacements, not {self.system!r}")
        if self.data:
            if not Path(self.data).is_file():
                raise ConfigError("--data", f"file not found: {self.data}")
        if self.faults and not Path(self.faults).is_file():
            raise ConfigError("--faults", f"file not found: {self.faults}")
        if not self.out:
            raise ConfigError("--out", "must name a directory")
        if self.checkpoint_every and self.system not in ("recover", "ckpt-restart", "elastic"):
            raise ConfigError("--checkpoint-every", f"{self.system} writes no checkpoints")
        if self.resume_from:
            if self.system != "recover":
                raise ConfigError("--resume", f"only --system recover resumes from checkpoints, not {self.system}")
            path = Path(self.resume_from)
            ckpts = CheckpointDir(self.checkpoint_root())
            if path.parent.resolve() != ckpts.root.resolve() or \
                    path.name not in [ckpts.path(s).name for s in ckpts.complete_steps()]:
                raise ConfigError("--resume", f"{path} is not a complete checkpoint of {ckpts.root}")
            if self.start_step >= self.steps:
                raise ConfigError("--steps", f"must exceed the checkpoint's step {self.start_step}, got {self.steps}")

    # ---- serialisation -----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TrainConfig":
        """Read DIR/config.json (the `train` section, or a bare TrainConfig dict)."""
        d = json.loads(Path(path).read_text())
        return cls.from_dict(d.get("train", d))


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def field_flag(cls: type, name: str) -> str:
    """The flag that sets field `name` of dataclass `cls` on the command line: its own, the
    one its metadata names (`flag`), or the shared one of the field it is the `same_as`."""
    meta = next(f.metadata for f in fields(cls) if f.name == name)
    return meta.get("flag") or flag_name(meta.get("same_as") or name)


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add one `--flag` per dataclass field, typed by its default, documented by its help.

    A field whose metadata says `same_as="name"` is the same concept as another config's
    field `name` (a baseline's checkpoint interval and recover's): it takes that field's
    flag and gets none of its own, so one concept has one flag across systems. Its own old
    flag stays as a hidden alias (`--ckpt-every` still parses), so scripts keep working."""
    for f in fields(cls):
        if f.name in skip or f.metadata.get("cli") is False:
            continue
        help_text = f.metadata.get("help", "")
        default = f.default
        if f.metadata.get("flag"):  # a flag named for the concept; the field's own name stays a hidden alias
            kw0: dict[str, Any] = {"action": argparse.BooleanOptionalAction} if isinstance(default, bool) \
                else {"type": type(default), "metavar": f.name.upper()}
            parser.add_argument(f.metadata["flag"], dest=f.name, default=None,
                                help=f"{help_text} (default: {default!r})", **kw0)
            parser.add_argument(flag_name(f.name), dest=f.name, default=None, help=argparse.SUPPRESS, **kw0)
            continue
        if f.metadata.get("same_as"):
            kw: dict[str, Any] = {"action": argparse.BooleanOptionalAction} if isinstance(default, bool) \
                else {"type": type(default), "metavar": f.name.upper()}
            parser.add_argument(flag_name(f.name), dest=f.name, default=None, help=argparse.SUPPRESS, **kw)
            continue
        if isinstance(default, bool):
            parser.add_argument(
                flag_name(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                default=None, help=f"{help_text} (default: {default})",
            )
        else:
            parser.add_argument(
                flag_name(f.name), dest=f.name, type=type(default), default=None, metavar=f.name.upper(),
                help=f"{help_text} (default: {default!r})",
            )


def dataclass_from_args(cls: type, args: argparse.Namespace, **base: Any) -> Any:
    """Build `cls` from parsed flags; flags left unset keep `base` or the field default."""
    values = dict(base)
    for f in fields(cls):
        v = getattr(args, f.name, None)
        if v is None and f.metadata.get("same_as"):  # the shared flag (see add_dataclass_flags)
            v = getattr(args, f.metadata["same_as"], None)
        if v is not None:
            values[f.name] = v
    return cls(**values)
