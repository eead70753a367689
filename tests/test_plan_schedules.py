"""epl-plan's schedule comparison: each pipeline.strategy's predicted bubble and memory at
4, 8 and 16 stages, for a cluster one does not have. Pure Python, no TensorFlow."""

import json

import pytest

from epl_trainer.core.plan.ir import PIPELINE_STRATEGIES
from epl_trainer.runtime import plan_cli

BERT = ["--model", "bert", "--size", "large", "--num_micro_batch", "8", "--micro_batch_size", "4"]


def test_schedules_at_4_8_and_16_stages(capsys):
    assert plan_cli.main([*BERT, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["schedules"]
    assert [(r["stages"], r["strategy"]) for r in rows] == [
        (s, strategy) for s in (4, 8, 16) for strategy in PIPELINE_STRATEGIES
    ]
    by = {(r["stages"], r["strategy"]): r for r in rows}
    for stages in (4, 8, 16):
        one_f_one_b, gpipe, zb = (
            by[stages, name] for name in ("PreferBackward", "PreferForward", "ZeroBubbleH1")
        )
        assert one_f_one_b["bubble"] == pytest.approx((stages - 1) / (8 + stages - 1))
        assert gpipe["bubble"] == one_f_one_b["bubble"]
        assert zb["bubble"] == pytest.approx((stages - 1) / (3 * 8 + stages - 1))
        # Activation sets alive on stage 0 / the last stage.
        assert gpipe["in_flight"] == [8, 8]
        assert one_f_one_b["in_flight"] == [min(stages, 8), 1]
        assert zb["in_flight"] == [min(stages, 8), min(stages, 8)]
        # Stage 0 keeps as many as with 1F1B: ZB-H1's largest peak is no larger than
        # GPipe's, and the later stages' extra micro-batches never exceed stage 0's.
        assert one_f_one_b["largest_peak"] <= zb["largest_peak"] <= gpipe["largest_peak"]
    # Interleaved 1F1B, v = 2: BERT-large's 24 layers cut into 8 and 16 stages, not 32.
    interleaved = {r["stages"]: r for r in rows if r["strategy"] == "Interleaved1F1B"}
    assert {r["virtual_stages"] for r in interleaved.values()} == {2}
    assert "Cannot cut 32 stages" in interleaved[16]["error"]
    for devices in (4, 8):
        row = interleaved[devices]
        assert row["bubble"] == pytest.approx((devices - 1) / (2 * 8 + devices - 1))
        assert row["bubble"] < by[devices, "PreferBackward"]["bubble"]
    # Device 0 keeps p (1 + (p-1)/(p v)) micro-batches' worth (M = 8 > p = 4), or all 8.
    assert interleaved[4]["in_flight"] == [4 * (1 + 3 / 8), 2.5]
    assert interleaved[8]["in_flight"] == [8, 4.5]


def test_the_report_prints_the_comparison(capsys):
    assert (
        plan_cli.main(
            [
                *BERT,
                "--num_stages",
                "4",
                "--gpu_per_worker",
                "4",
                "--pipeline_strategy",
                "ZeroBubbleH1",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    with capsys.disabled():
        print("\n" + text[text.index("Pipeline bubble") :])
    assert "Pipeline bubble: (S-1)/(3M+S-1) = (4-1)/(3x8+4-1) = 0.111" in text
    assert "Schedules on 4, 8 and 16 devices" in text
    assert "16       ZeroBubbleH1         0.385" in text
    assert "4        Interleaved1F1B v=2  0.158   5.5 / 2.5" in text


def test_the_report_of_an_interleaved_plan(capsys):
    args = ["--num_stages", "8", "--gpu_per_worker", "4", "--virtual_stages", "2"]
    assert plan_cli.main([*BERT, *args, "--pipeline_strategy", "Interleaved1F1B"]) == 0
    text = capsys.readouterr().out
    assert (
        "Pipeline bubble: (p-1)/(vM+p-1) = (4-1)/(2x8+4-1), p = S/v = 8/2 devices = 0.158" in text
    )
    assert "8 TaskGraphs on 4 device slot(s) (2 stages each, round-robin)" in text
    # The fit is judged per device, over its two stages, not per stage.
    peaks, _ = plan_cli.device_peaks(
        plan_cli.plan_and_estimate(
            plan_cli.analytic.bert("large", seq_len=384),
            plan_cli.estimate.TrainOptions(micro_batch_size=4),
            plan_cli.PlanRequest(8, 8, "Interleaved1F1B", virtual_stages=2),
            1,
            4,
        )
    )
    assert "each device runs 2 of these stages (stage k on device k mod 4)" in text
    assert f"device 0 {plan_cli.fmt(peaks[0])}, device 1 {plan_cli.fmt(peaks[1])}" in text
    with pytest.raises(SystemExit):  # 8 stages, 3 per device
        plan_cli.main([*BERT, "--num_stages", "8", "--virtual_stages", "3",
                       "--pipeline_strategy", "Interleaved1F1B"])  # fmt: skip
    assert "pipeline.virtual_stages=3 stages per device must divide" in capsys.readouterr().err
