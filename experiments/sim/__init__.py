"""recover.experiments.sim: a calibrated discrete-event simulator of one training job.

Contract: the simulator reproduces, at cluster scale, the comparison the project runs
for real on this machine: the same systems (recover, checkpoint-restart, elastic,
torchft), the same failure model (the fault-injection harness's samplers), costs
measured here or published (calibration.py, every value with its source), and the
same definition of effective throughput (engine.py). `recover simulate SCENARIO`
(experiments/commands/simulate.py) runs the named scenarios of scenarios.py.

Modules: model (iteration time), failures (events from the samplers or a plan),
engine (the event loop and the accounting), policies (one per system),
youngdaly (checkpoint intervals), calibration (parameter sets and their sources),
scenarios (named set-ups, sweeps, output files), validation (against real runs).
"""
