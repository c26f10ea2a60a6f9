"""The coordinator's command line is built in one place (core/launch/coordinator_command.py).

Pure: the arguments, and that the coordinator process's own parser reads them back.
"""
from __future__ import annotations

from recover.core.launch.coordinator_command import MODULE, coordinator_args, rebuild_args


def test_a_first_start_and_a_restart_say_what_the_process_reads():
    assert MODULE == "recover.core.coordinator.process"
    assert coordinator_args("run/config.json", "store") == ["--config", "run/config.json", "--mode", "store"]
    assert coordinator_args("c.json", "recover", host="0.0.0.0", store_port=0, control_port=0) == [
        "--config", "c.json", "--mode", "recover", "--host", "0.0.0.0", "--store-port", "0", "--control-port", "0"]
    assert rebuild_args("10.0.0.1", 29500, 29501, [0, 2]) == [
        "--rebuild", "--host", "10.0.0.1", "--store-port", "29500", "--control-port", "29501", "--expect", "0,2"]
