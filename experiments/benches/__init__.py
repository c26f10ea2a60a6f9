"""recover.experiments.benches: the benchmarks, one module per measurement.

Contract: each module measures one thing and writes its figures as JSON (under
results/bench/ by default); nothing here is asserted on, and ratios are taken within one
run (the machines are shared and noisy). `recover bench NAME`
(experiments/commands/bench.py) checks the flags and imports the module only when its
command runs (most import torch). Two are run with `python -m` instead, and one is a helper.

- recovery: `recover bench recovery`, what a fault costs each system, with real kills.
- checkpoint: `recover bench checkpoint`, DCP save, async save and load throughput.
- checkpoint_stall: `recover bench checkpoint-stall`, recover's async checkpoint stall against an iteration.
- dtype: `recover bench dtype`, iteration time, fp32 against bf16 autocast.
- digest: `recover bench digest`, the votes' weights digest against an iteration.
- iteration: `recover bench iteration`, failure-free iteration time of recover against plain.
- coordinator_state_machine: `recover bench coordinator`, the coordinator state machine's cost against R.
- coordinator_service: `recover bench coordinator --service`, the real membership service against N simulated replicas.
- replica_clients: the simulated replicas coordinator_service starts (a helper, `python -m`).
- coordinator_restart: `recover bench coordinator-restart`, seconds from a coordinator kill to the next commit.
- state_transfer: `recover bench transfer`, healing a newcomer against a bare broadcast of the same bytes.
- soak: `recover bench soak`, the coordinator state machine over a long run with replacements.
- store_guard: `recover bench store-guard`, a rendezvous's store traffic through the store guard against the bare store.
- exact_compute: `python -m`, what `--exact` costs in the compute against fp32.
- exact_precision: `python -m`, the loss curves of `--exact` against fp32.
"""
