"""The "cpu" device's calibration file (core/plan/cpu_calibration.json): read as the device
table's entry, written by bench/plan_calibrate.py --write, and a warning wherever its rates
are another CPU's (no TensorFlow)."""

import json
import os
import sys

import pytest

from epl_trainer.core.plan import devices
from epl_trainer.runtime import plan_cli

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "bench"))
import plan_calibrate


def test_the_cpu_entry_is_the_calibration_file():
    stored = devices.read_cpu_calibration()
    cpu = devices.device_by_name("cpu")
    assert cpu.peak_flops == stored["matmul_flops"]
    assert cpu.pool_matmul_flops == stored["pool_matmul_flops"]  # pairs as tuples
    assert isinstance(cpu.pool_matmul_flops[0], tuple)
    assert stored["machine"]["cpu"] in cpu.sources["peak_flops"]
    assert set(stored["machine"]) == {"cpu", "cores"}


def test_a_calibration_of_another_cpu_is_named_as_such(monkeypatch):
    here = devices.this_cpu()
    assert here["cores"] == os.cpu_count() and here["cpu"]
    monkeypatch.setitem(devices._CPU_MEASURED, "machine", dict(here))
    assert devices.stale_cpu_calibration() == ""
    monkeypatch.setitem(devices._CPU_MEASURED, "machine", {"cpu": "Other CPU", "cores": 64})
    stale = devices.stale_cpu_calibration()
    assert "calibrated on Other CPU with 64 cores" in stale and here["cpu"] in stale


def test_epl_plan_warns_when_the_cpu_device_is_another_machines(monkeypatch, capsys):
    args = ["--model", "transformer", "--layers", "2", "--hidden", "64", "--heads", "2",
            "--seq_len", "16", "--vocab", "100", "--micro_batch_size", "2"]  # fmt: skip
    monkeypatch.setitem(devices._CPU_MEASURED, "machine", {"cpu": "Other CPU", "cores": 64})
    assert plan_cli.main([*args, "--device", "cpu"]) == 0
    assert "warning: the \"cpu\" device was calibrated on Other CPU" in capsys.readouterr().out
    assert plan_cli.main([*args, "--device", "a100-80gb"]) == 0
    assert "warning" not in capsys.readouterr().out
    monkeypatch.setitem(devices._CPU_MEASURED, "machine", devices.this_cpu())
    assert plan_cli.main([*args, "--device", "cpu"]) == 0
    assert "warning" not in capsys.readouterr().out


@pytest.fixture
def calibration_file(tmp_path, monkeypatch):
    path = tmp_path / "cpu_calibration.json"
    path.write_text(json.dumps({"matmul_flops": 1e11, "memory_bandwidth": 2e10,
                                "machine": {"cpu": "Other CPU", "cores": 64}}))  # fmt: skip
    monkeypatch.setattr(devices, "CPU_CALIBRATION_FILE", str(path))
    monkeypatch.setitem(devices._CPU_MEASURED, "machine", {"cpu": "Other CPU", "cores": 64})
    return path


def test_write_replaces_what_was_measured_and_records_this_cpu(calibration_file):
    plan_calibrate.write_calibration({"matmul_flops": 3e11, "measured": "2026-11-29"})
    stored = devices.read_cpu_calibration(str(calibration_file))
    assert stored["matmul_flops"] == 3e11 and stored["memory_bandwidth"] == 2e10
    assert stored["machine"] == devices.this_cpu() and stored["measured"] == "2026-11-29"
    assert not os.path.exists(str(calibration_file) + ".tmp")


def test_a_part_alone_is_not_written_over_another_cpus_calibration(calibration_file):
    """Its other rates would stay the other machine's under this machine's name."""
    with pytest.raises(SystemExit, match="--write with --only matmul: the \"cpu\" device was "
                       "calibrated on Other CPU"):  # fmt: skip
        plan_calibrate.check_writable(["matmul"])
    plan_calibrate.check_writable(list(plan_calibrate.PARTS))  # every part: allowed
    devices._CPU_MEASURED["machine"] = devices.this_cpu()
    plan_calibrate.check_writable(["matmul"])  # the same CPU: allowed


def test_unknown_parts_are_refused(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["plan_calibrate.py", "--only", "matmul,gpu"])
    with pytest.raises(SystemExit):
        plan_calibrate.main()
    assert "unknown --only parts ['gpu']" in capsys.readouterr().err


def test_a_rate_that_is_not_positive_is_refused():
    """A slope of 0 or less: the copies of a body did not run one after the other."""
    plan_calibrate.check_rates({"matmul_flops": 3e11, "pool_memory_bandwidth": [[1, 5e10]]})
    with pytest.raises(SystemExit, match=r"pool_matmul_flops measured \[-1000.0\]"):
        plan_calibrate.check_rates({"pool_matmul_flops": [[1, 3e11], [2, -1e3]]})
