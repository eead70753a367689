"""epl-plan: plans and estimates for virtual clusters far larger than this machine."""

import json
import os
import subprocess
import sys

import pytest

from epl_trainer.runtime import plan_cli

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)


def _json(capsys, *args):
    assert plan_cli.main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_reproduces_the_zero_paper_per_device_model_states(capsys):
    args = ["--params", "7.5e9", "--num_workers", "8", "--gpu_per_worker", "8", "--amp", "master"]
    paper = {"none": 120.0, "v0": 31.4, "v1": 16.6, "v2": 1.9}
    rows = []
    for level, expected in paper.items():
        data = _json(capsys, *args, "--zero", level)
        states = data["stages"][0]["model_states"]
        rows.append(
            f"  --zero {level:4}  paper {expected:5.1f} GB  epl-plan {states / 1e9:6.2f} GB"
        )
        assert data["data_parallel"] == 64
        assert round(states / 1e9, 1) == expected
    with capsys.disabled():
        print("\nepl-plan --params 7.5e9 on 8 x 8 devices --amp master (ZeRO paper: K = 12)")
        print("\n".join(rows))
    # Every level is also in the ZeRO table of each report.
    table = {name.split()[0]: b / 1e9 for name, b in data["zero_levels"].items()}
    assert {k: round(v, 1) for k, v in table.items()} == paper


@pytest.mark.parametrize(
    "level, collective",
    [
        ("none", "all-reduce"),
        ("v0", "all-reduce + all-gather"),
        ("v1", "reduce-scatter + all-gather"),
        ("v2", "reduce-scatter per micro-batch + all-gathers of the weights"),
    ],
)
def test_the_text_report_names_each_zero_levels_collectives(capsys, level, collective):
    # The JSON report skipped the text renderer: `--zero v2` without --json raised
    # KeyError: 'v2' in its traffic section.
    args = ["--params", "7e9", "--num_workers", "1", "--gpu_per_worker", "8", "--zero", level]
    assert plan_cli.main(args) == 0
    assert f"data-parallel ({collective})" in capsys.readouterr().out


def test_bert_large_on_64_workers_x_8_gpus(capsys):
    args = ["--model", "bert", "--size", "large", "--num_workers", "64", "--gpu_per_worker", "8"]
    args += ["--num_stages", "4", "--num_micro_batch", "8", "--micro_batch_size", "4"]
    args += ["--zero", "v1", "--amp", "--gc", "--device_memory", "32GB"]
    assert plan_cli.main(args) == 0
    text = capsys.readouterr().out
    with capsys.disabled():
        print("\n" + text)
    assert "Plan: data-parallel degree 128, 4 device(s) per replica" in text
    assert "Cluster: 64 worker(s) x 8 device(s)" in text
    assert "Pipeline bubble: (S-1)/(M+S-1) = (4-1)/(8+4-1) = 0.273" in text
    assert "reduce-scatter + all-gather" in text and "of 32 GB" in text
    data = _json(capsys, *args)
    assert data["global_batch"] == 128 * 8 * 4
    assert [s["devices"] for s in data["stages"]] == [128] * 4
    assert sum(s["params"] for s in data["stages"]) == 334_094_338
    assert [s["inflight_micro_batches"] for s in data["stages"]] == [4, 3, 2, 1]
    assert data["options"] == {
        "micro_batch_size": 4,
        "num_micro_batch": 8,
        "pipeline_strategy": "PreferBackward",
        "zero": "v1",
        "amp": "O1",
        "gc": True,
        "optimizer": "adam",
    }


def test_described_transformer_and_resnet(capsys):
    sizes = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--vocab", "50000"]
    data = _json(capsys, "--model", "transformer", *sizes, "--seq_len", "2048", "--num_stages", "8",
                 "--gpu_per_worker", "8", "--num_micro_batch", "16")  # fmt: skip
    assert data["params"] > 6e9 and data["num_stages"] == 8
    # 32 equal layers over 8 stages: 4 each (nodes: embeddings, layer_0..31, head). The
    # vocab head costs almost a layer, but 3 layers + head would leave 5 layers elsewhere.
    assert data["cuts"] == list(range(5, 33, 4))
    acts = data["stages"][1]["activations_per_micro_batch"]
    assert acts["gc"] < acts["amp"] < acts["fp32"]
    resnet = _json(capsys, "--model", "resnet50", "--num_workers", "4", "--gpu_per_worker", "8",
                   "--micro_batch_size", "32")  # fmt: skip
    assert resnet["params"] == 25_636_712 and resnet["data_parallel"] == 32


def test_settings_come_from_the_trainer_config_unless_given(capsys):
    base = ["--model", "bert", "--size", "tiny", "--seq_len", "64", "--gpu_per_worker", "2"]
    from_config = _json(capsys, *base, "--epl_set", "zero.level=v0", "--epl_set",
                        "gradient_checkpoint.type=auto", "--epl_set", "amp.level=O1")  # fmt: skip
    assert from_config["options"]["zero"] == "v0"
    assert from_config["options"]["gc"] is True and from_config["options"]["amp"] == "O1"
    flags_win = _json(capsys, *base, "--epl_set", "zero.level=v0", "--zero", "v1", "--no-gc")
    assert flags_win["options"]["zero"] == "v1" and flags_win["options"]["gc"] is False


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "transformer", "--layers", "2"], "needs --hidden --heads --vocab --seq_len"),
        (["--params", "1e9", "--model", "bert"], "exactly one of --model or --params"),
        (["--model", "bert", "--num_stages", "3", "--gpu_per_worker", "4"], "must divide"),
        (["--model", "bert", "--num_stages", "30"], "Cannot cut 30 stages"),
        (["--params", "1e9", "--device_memory", "lots"], "Cannot read a byte count"),
        (["--model", "bert", "--size", "huge"], "size must be one of"),
        (["--model", "resnet50", "--size", "large"], "--model resnet50 does not take --size"),
        (["--params", "1e9", "--layers", "2"], "--params does not take --layers"),
        (["--params", "1e9", "--epl_set", "zero.level=v9"], "zero.level"),
    ],
)
def test_bad_arguments_exit_2_with_the_reason(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        plan_cli.main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_byte_counts():
    assert plan_cli.parse_bytes("32GB") == 32e9 and plan_cli.parse_bytes("1GiB") == 2**30
    assert plan_cli.parse_bytes("3.2e10") == 32e9
    with pytest.raises(ValueError, match="Cannot read a byte count from '32 GX'"):
        plan_cli.parse_bytes("32 GX")
    assert plan_cli.fmt(31.41e9) == "31.4 GB" and plan_cli.fmt(120e9) == "120 GB"


def test_needs_no_tensorflow_and_is_a_console_script():
    code = (
        "import sys\n"
        "from epl_trainer.runtime import plan_cli\n"
        "plan_cli.main(['--model', 'bert', '--num_workers', '64', '--gpu_per_worker', '8'])\n"
        "assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules\n"
    )
    env = {**os.environ, "PYTHONPATH": os.path.abspath(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert result.returncode == 0, result.stderr
    assert "data-parallel degree 512" in result.stdout
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        scripts = f.read().split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    assert 'epl-plan = "epl_trainer.runtime.plan_cli:main"' in scripts


def test_predicted_flops_per_step(capsys):
    args = ["--model", "bert", "--size", "base", "--seq_len", "128", "--num_workers", "2"]
    args += ["--gpu_per_worker", "4", "--micro_batch_size", "8"]
    data = _json(capsys, *args)
    forward = plan_cli.model_from_args(plan_cli.build_parser().parse_args(args), None).flops
    assert data["model_flops_per_step"] == data["device_flops_per_step"] == 3 * forward * 64
    with_gc = _json(capsys, *args, "--gc")
    assert with_gc["device_flops_per_step"] == 4 * forward * 64  # the recomputed forward

    assert plan_cli.main([*args, "--epl_set", "profiler.peak_tflops=100"]) == 0
    text = capsys.readouterr().out
    assert "FLOPs per step: 3 x 22.4G forward per sample x global batch 64 = 4.3T" in text
    # 4.298T / (100 TFLOP/s x 2 workers) = 21.49 ms.
    assert "fastest step at the peak (100 TFLOP/s x 2 worker(s)): 21.49 ms" in text
    assert plan_cli.main([*args, "--peak_tflops", "200", "--gc"]) == 0
    text = capsys.readouterr().out
    assert "(200 TFLOP/s x 2 worker(s)): 14.3" in text and "MFU 75%" in text
    assert plan_cli.main(["--params", "1e9"]) == 0
    assert "FLOPs per step" not in capsys.readouterr().out  # no FLOPs without a model
