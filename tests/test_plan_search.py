"""epl-plan --search (core/plan/search.py): the fastest layouts that fit, by arithmetic."""

import dataclasses
import json

import pytest

from epl_trainer.config.sections import Config
from epl_trainer.core.plan import analytic, devices, search, step_time
from epl_trainer.runtime import plan_cli

A100 = devices.device_by_name("a100-80gb")


def _model(layers=8):
    return analytic.transformer(layers, 512, 8, 8000, 512, name="t")


def _device(memory_gb, per_node=4):
    return dataclasses.replace(A100, memory_bytes=memory_gb * 1e9, devices_per_node=per_node)


# Memories from roomy to tight for this model on 8 devices (peaks span about 0.2-5 GB).
MEMORIES = (80, 2, 1, 0.6, 0.4)


@pytest.mark.parametrize("memory_gb", MEMORIES)
def test_never_proposes_a_layout_that_does_not_fit(memory_gb):
    device = _device(memory_gb)
    found = search.search(_model(), device, 8, 32, top=50)
    for prediction in found.layouts:
        assert prediction.fits and prediction.peak_memory_bytes <= device.memory_bytes
        # The memory model says so again for the layout alone.
        again = step_time.predict(_model(), prediction.layout, device)
        assert again.peak_memory_bytes == prediction.peak_memory_bytes <= device.memory_bytes
    times = [p.step_time_s for p in found.layouts]
    assert times == sorted(times)


@pytest.mark.parametrize("memory_gb", (80, 1, 0.4))
@pytest.mark.parametrize("num_devices, batch", [(4, 16), (8, 32)])
def test_picks_the_fastest_of_the_exhaustive_enumeration(memory_gb, num_devices, batch):
    """Trying gc and offload only where a layout does not fit without them finds the same
    best layout as predicting every combination."""
    device = _device(memory_gb)
    model = _model()
    found = search.search(model, device, num_devices, batch, top=1)
    # Independently of the search: the minimum over every candidate and memory option.
    fitting = []
    for fields in search.candidate_layouts(model, device, num_devices, batch):
        for gc in (False, True):
            for offload in (False, True):
                prediction = step_time.predict(
                    model, step_time.Layout(**fields, gc=gc, offload=offload), device
                )
                if prediction.fits:
                    fitting.append(prediction.step_time_s)
    if not fitting:
        assert found.layouts == ()
        return
    assert found.best.step_time_s == pytest.approx(min(fitting))
    if memory_gb == 80:  # every layout fits as it is: gc and offload never tried
        assert found.evaluated * 4 == len(fitting)


def test_tight_memory_is_met_with_sharding_recomputation_or_offload():
    roomy = search.search(_model(), _device(80), 8, 32).best.layout
    tight = search.search(_model(), _device(0.4), 8, 32).best
    assert tight.peak_memory_bytes <= 0.4e9
    heavier = (tight.layout.zero == "v2", tight.layout.gc, tight.layout.offload,
               tight.layout.pipeline_parallel > 1, tight.layout.tensor_parallel > 1)  # fmt: skip
    assert any(heavier) and tight.layout != roomy
    assert search.search(_model(), _device(0.01), 8, 32).layouts == ()


def test_every_layout_makes_the_batch_and_uses_every_device():
    for fields in search.candidate_layouts(_model(), A100, 16, 64):
        layout = step_time.Layout(**fields)
        assert layout.devices == 16 and layout.global_batch == 64
        assert layout.num_stages <= _model().max_stages
    # A model no layer of which tensor parallelism splits is searched with tp 1 only.
    whole = analytic.params_only(1e9)
    assert {f["tensor_parallel"] for f in search.candidate_layouts(whole, A100, 8, 64)} == {1}


def test_cli_search_prints_layouts_and_saves_the_best_config(capsys, tmp_path):
    args = ["--model", "transformer", "--layers", "8", "--hidden", "512", "--heads", "8"]
    args += ["--vocab", "8000", "--seq_len", "512", "--num_workers", "2", "--gpu_per_worker", "4"]
    args += ["--device", "a100-40gb", "--search", "--global_batch", "32", "--top", "3"]
    saved = tmp_path / "best.json"
    assert plan_cli.main([*args, "--json", "--save_config", str(saved)]) == 0
    data = json.loads(capsys.readouterr().out)
    layouts = data["layouts"]
    assert 1 <= len(layouts) <= 3
    for layout in layouts:
        for key in ("step_time_s", "tflops_per_device", "mfu", "peak_memory_bytes", "config"):
            assert key in layout
        assert layout["fits"] and layout["global_batch"] == 32 and layout["devices"] == 8
    times = [layout["step_time_s"] for layout in layouts]
    assert times == sorted(times)
    best = json.loads(saved.read_text())
    assert best == layouts[0]["config"]
    Config.from_file(str(saved), {})  # the trainer reads it
    assert plan_cli.main(args) == 0
    text = capsys.readouterr().out
    assert "Fastest layouts that fit" in text and "Config of the best" in text
    with pytest.raises(SystemExit):
        plan_cli.main(["--params", "1e9", "--search"])
    assert "--search needs a device" in capsys.readouterr().err
