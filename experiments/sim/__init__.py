"""recover.experiments.sim: a calibrated discrete-event simulator of one training job.

Contract: the simulator reproduces, at cluster scale, the comparison the project runs
for real on this machine: the same systems under the same names (experiments.labels:
recover, ckpt-restart, elastic-keep-global, elastic-keep-per-replica, torchft), the
same failure model (the fault-injection harness's samplers), costs measured here or
published (calibration.py, every value with its source; measured.py computes the local
ones from committed runs and benches), and the same two throughput metrics
(experiments/throughput.py). `recover simulate SCENARIO`
(experiments/commands/simulate.py) runs the named scenarios of named_scenarios.py.

Modules, one concept each: model (iteration time), failures (events from the
samplers or a plan), record (what a run accounts for), policy_base (the policy base
class), system_policies (one per system), costs (what each event costs), loop (the event
loop), youngdaly (checkpoint intervals), realruns (real runs as the simulator reads
them), measured (the local measurements, computed from committed results),
calibration (parameter sets and their sources), scenario_runner (a scenario
and running it), named_scenarios (the named ones), report (summary.json, timeseries.csv),
sweeps (scale and sensitivity), validation (against real runs).
"""
