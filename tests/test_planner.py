"""Planner and Plan: EPL's device arithmetic and layouts. No TensorFlow needed."""

import json

import pytest

from epl_trainer.core.plan.ir import Device, Plan, PlanError, StrategySpec, TaskGraph
from epl_trainer.core.plan.planner import build_plan, ordered_devices


def cluster(workers: int, per_worker: int) -> list[list[str]]:
    return [
        [f"/job:worker/replica:0/task:{w}/device:CPU:{d}" for d in range(per_worker)]
        for w in range(workers)
    ]


def rep(n=None, name=None):
    return StrategySpec("replicate", n, name)


def spl(n=None, name=None):
    return StrategySpec("split", n, name)


def short(devices) -> list[str]:
    return [d.short_name for d in devices]


# ------------------------------------------------------------------ EPL doc cases
def test_two_stage_pipeline_on_8_devices_gives_4_pipelines():
    plan = build_plan([rep(1, "stage_0"), rep(1, "stage_1")], cluster(1, 8), 0, num_micro_batch=4)
    assert plan.num_replicas == 4
    assert plan.devices_per_replica == 2
    assert [tg.name for tg in plan.taskgraphs] == ["stage_0", "stage_1"]
    assert [short(plan.placement[r][0]) for r in range(4)] == [
        ["w0:CPU:0"],
        ["w0:CPU:2"],
        ["w0:CPU:4"],
        ["w0:CPU:6"],
    ]
    assert short(plan.taskgraph_devices(1)) == ["w0:CPU:1", "w0:CPU:3", "w0:CPU:5", "w0:CPU:7"]
    assert plan.global_batch_factor == 16


def test_replicate_1_alone_is_data_parallel_over_all_devices():
    plan = build_plan([rep(1)], cluster(1, 8), 0, num_micro_batch=1)
    assert plan.num_replicas == 8
    assert plan.taskgraphs == (TaskGraph(0, "taskgraph_0", "replicate", 1),)
    assert plan.global_batch_factor == 8


def test_replicate_none_means_one_device():
    plan = build_plan([rep(None)], cluster(1, 8), 0, num_micro_batch=1)
    assert plan.taskgraphs[0].device_count == 1
    assert plan.num_replicas == 8


def test_colocated_replicate_8_and_split_8_is_one_replica_sharing_devices():
    plan = build_plan(
        [rep(8, "resnet"), spl(8, "classifier")],
        cluster(1, 8),
        0,
        num_micro_batch=1,
        colocate_split_and_replicate=True,
    )
    assert plan.num_replicas == 1
    assert plan.devices_per_replica == 8
    assert plan.placement[0][0] == plan.placement[0][1]
    assert len(plan.placement[0][1]) == 8


def test_split_8_without_colocation_on_8_devices_is_an_error():
    with pytest.raises(
        PlanError,
        match=r"16 = resnet:8 \+ classifier:8.*exceed.*"
        r"8 = 1 worker x 8 devices.*colocate_split_and",
    ):
        build_plan([rep(8, "resnet"), spl(8, "classifier")], cluster(1, 8), 0, num_micro_batch=1)


def test_replicate_2_on_8_devices_gives_4_replicas_of_2_devices():
    plan = build_plan([rep(2)], cluster(1, 8), 0, num_micro_batch=1)
    assert plan.num_replicas == 4
    assert [short(row[0]) for row in plan.placement] == [
        ["w0:CPU:0", "w0:CPU:1"],
        ["w0:CPU:2", "w0:CPU:3"],
        ["w0:CPU:4", "w0:CPU:5"],
        ["w0:CPU:6", "w0:CPU:7"],
    ]


def test_split_none_spans_the_job_when_colocated():
    plan = build_plan(
        [rep(1), spl(None)], cluster(2, 4), 0, num_micro_batch=1, colocate_split_and_replicate=True
    )
    assert plan.taskgraphs[1].device_count == 8
    assert plan.num_replicas == 1
    assert short(plan.placement[0][0]) == ["w0:CPU:0"]


def test_split_none_without_colocation_asks_for_device_count():
    with pytest.raises(PlanError, match=r"split TaskGraph 'head' has no device_count"):
        build_plan([rep(1), spl(None, "head")], cluster(1, 8), 0, num_micro_batch=1)


# -------------------------------------------------------------- multi-worker layout
def test_two_workers_two_stages_prefer_intra_node_keeps_replicas_on_one_worker():
    plan = build_plan([rep(1, "stage_0"), rep(1, "stage_1")], cluster(2, 4), 1, num_micro_batch=2)
    assert plan.num_replicas == 4
    assert [plan.replica_workers(r) for r in range(4)] == [(0,), (0,), (1,), (1,)]
    assert plan.replicas_on_worker(0) == (0, 1)
    assert plan.replicas_on_worker(1) == (2, 3)
    assert plan.local_replicas == (2, 3)
    assert short(plan.replica_devices(2)) == ["w1:CPU:0", "w1:CPU:1"]


def test_two_workers_two_stages_spread_across_workers():
    plan = build_plan(
        [rep(1, "stage_0"), rep(1, "stage_1")],
        cluster(2, 4),
        0,
        num_micro_batch=2,
        prefer_intra_node=False,
    )
    assert plan.num_replicas == 4
    assert short(plan.replica_devices(0)) == ["w0:CPU:0", "w1:CPU:0"]
    assert short(plan.replica_devices(3)) == ["w0:CPU:3", "w1:CPU:3"]
    assert all(plan.replica_workers(r) == (0, 1) for r in range(4))
    assert plan.replicas_on_worker(0) == ()
    assert plan.local_replicas == ()


def test_replica_larger_than_a_worker_spans_workers():
    plan = build_plan([rep(2), rep(4)], cluster(2, 3), 0, num_micro_batch=1)
    assert plan.num_replicas == 1
    assert short(plan.placement[0][0]) == ["w0:CPU:0", "w0:CPU:1"]
    assert short(plan.placement[0][1]) == ["w0:CPU:2", "w1:CPU:0", "w1:CPU:1", "w1:CPU:2"]
    assert plan.replica_workers(0) == (0, 1)


def test_ordered_devices():
    names = [d.name[-5:] for d in ordered_devices(cluster(2, 2), prefer_intra_node=False)]
    assert names == ["CPU:0", "CPU:0", "CPU:1", "CPU:1"]
    workers = [d.worker for d in ordered_devices(cluster(2, 2), prefer_intra_node=False)]
    assert workers == [0, 1, 0, 1]
    devices = ordered_devices(cluster(2, 2))
    assert devices[2] == Device(1, 0, "/job:worker/replica:0/task:1/device:CPU:0")


# ------------------------------------------------------------------------ errors
def test_devices_per_replica_must_divide_the_job():
    with pytest.raises(
        PlanError,
        match=r"Devices per model replica \(3 = stage_0:1 \+ "
        r"stage_1:2\) must divide the devices in the job "
        r"\(8 = 2 workers x 4 devices\)",
    ):
        build_plan([rep(1, "stage_0"), rep(2, "stage_1")], cluster(2, 4), 0, num_micro_batch=1)


def test_colocated_error_shows_max():
    with pytest.raises(PlanError, match=r"\(3 = max\(a:3, b:1\)\) must divide"):
        build_plan(
            [rep(3, "a"), spl(1, "b")],
            cluster(1, 8),
            0,
            num_micro_batch=1,
            colocate_split_and_replicate=True,
        )


@pytest.mark.parametrize("value", [0, -1, 1.5, True, None])
def test_num_micro_batch_must_be_positive_int(value):
    with pytest.raises(PlanError, match="num_micro_batch must be an int >= 1"):
        build_plan([rep(1)], cluster(1, 2), 0, num_micro_batch=value)


def test_workers_must_have_equal_device_counts():
    with pytest.raises(PlanError, match=r"devices per worker = \[4, 2\]"):
        build_plan([rep(1)], [cluster(1, 4)[0], cluster(2, 2)[1]], 0, num_micro_batch=1)


def test_worker_index_out_of_range():
    with pytest.raises(
        PlanError,
        match=r"worker_index must be in \[0, 2\). Received: "
        r"worker_index=2",
    ):
        build_plan([rep(1)], cluster(2, 2), 2, num_micro_batch=1)


def test_empty_and_malformed_taskgraphs():
    with pytest.raises(PlanError, match="at least one TaskGraph"):
        build_plan([], cluster(1, 2), 0, num_micro_batch=1)
    with pytest.raises(PlanError, match="kind, device_count and name"):
        build_plan([object()], cluster(1, 2), 0, num_micro_batch=1)
    with pytest.raises(PlanError, match=r"device_count of TaskGraph 0 \(x\) must be an int"):
        build_plan([StrategySpec("replicate", 0, "x")], cluster(1, 2), 0, num_micro_batch=1)


def test_duplicate_names_are_an_error():
    with pytest.raises(PlanError, match=r"unique.*\['s'\]"):
        build_plan([rep(1, "s"), rep(1, "s")], cluster(1, 2), 0, num_micro_batch=1)


def test_resolved_taskgraphs_are_accepted():
    plan = build_plan([TaskGraph(0, "body", "replicate", 2)], cluster(1, 4), 0, num_micro_batch=1)
    assert plan.num_replicas == 2


# ------------------------------------------------------------------ Plan as data
def test_summary_lists_taskgraphs_replicas_and_devices():
    plan = build_plan([rep(1, "stage_0"), rep(1, "stage_1")], cluster(2, 4), 0, num_micro_batch=4)
    text = plan.summary()
    assert "data-parallel degree 4" in text
    assert "2 device(s) per replica" in text
    assert "4 micro-batch(es)" in text
    assert "2 worker(s) x 4 device(s)" in text
    assert "replica 3" in text
    stage_1 = next(line for line in text.splitlines() if line.startswith("1 stage_1"))
    assert stage_1.split() == [
        "1",
        "stage_1",
        "replicate",
        "1",
        "w0:CPU:1",
        "w0:CPU:3",
        "w1:CPU:1",
        "w1:CPU:3",
    ]
    assert str(plan) == text


def test_summary_compresses_device_runs_and_elides_many_replicas():
    plan = build_plan([spl(4, "head")], cluster(1, 4), 0, num_micro_batch=1)
    assert "w0:CPU:0-3" in plan.summary()
    wide = build_plan([rep(1)], cluster(1, 12), 0, num_micro_batch=1)
    assert "replica 7" in wide.summary()
    assert "replica 8" not in wide.summary()
    assert "(4 more)" in wide.summary()


def test_to_dict_round_trips_through_json():
    plan = build_plan([rep(1, "a"), spl(2, "b")], cluster(2, 3), 1, num_micro_batch=2)
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan


def test_summary_shows_pipeline_strategy_stage_costs_and_cut():
    plan = build_plan(
        [rep(1, "stage_0"), rep(1, "stage_1"), rep(1, "stage_2")],
        cluster(1, 6),
        0,
        num_micro_batch=4,
        pipeline_strategy="PreferForward",
        stage_costs=[1.75e6, 1.75e6, 1.85e6],
        cut_description="stages 1.. start at node 29 'attn_4', node 57 'attn_8'",
    )
    text = plan.summary()
    print(f"\n{text}")
    assert "Pipeline: 3 TaskGraphs, strategy PreferForward" in text
    header = next(line for line in text.splitlines() if line.startswith("TaskGraph"))
    assert header.split()[:4] == ["TaskGraph", "kind", "devices", "cost"]
    stage_2 = next(line for line in text.splitlines() if line.startswith("2 stage_2"))
    assert stage_2.split()[:5] == ["2", "stage_2", "replicate", "1", "1.85M"]
    assert "Stage costs: 1.75M, 1.75M, 1.85M; spread max/min = 1.057" in text
    assert "Cut: stages 1.. start at node 29 'attn_4', node 57 'attn_8'" in text
    assert plan.stage_costs == (1.75e6, 1.75e6, 1.85e6)
    assert plan.stage_cost_spread == pytest.approx(1.85 / 1.75)
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan


def test_summary_without_costs_has_no_cost_column_and_one_taskgraph_no_pipeline():
    single = build_plan([rep(1)], cluster(1, 2), 0, num_micro_batch=1)
    assert single.pipeline_strategy == "PreferBackward"
    assert single.stage_costs is None and single.stage_cost_spread is None
    text = single.summary()
    assert "Pipeline:" not in text and "cost" not in text and "Cut:" not in text
    two = build_plan([rep(1, "a"), rep(1, "b")], cluster(1, 2), 0, num_micro_batch=2)
    assert "Pipeline: 2 TaskGraphs, strategy PreferBackward" in two.summary()


def test_plans_serialised_without_the_new_fields_still_load():
    plan = build_plan([rep(1, "a"), rep(1, "b")], cluster(1, 2), 0, num_micro_batch=2)
    data = plan.to_dict()
    for key in ("pipeline_strategy", "stage_costs", "cut_description"):
        del data[key]
    assert Plan.from_dict(data) == plan


def test_stage_costs_must_match_the_taskgraphs_and_strategy_must_be_known():
    with pytest.raises(PlanError, match=r"stage_costs has 1 entries for 2 TaskGraphs"):
        build_plan(
            [rep(1, "a"), rep(1, "b")], cluster(1, 2), 0, num_micro_batch=1, stage_costs=[1.0]
        )
    with pytest.raises(PlanError, match=r"pipeline_strategy must be one of .*'Backward'"):
        build_plan([rep(1)], cluster(1, 2), 0, num_micro_batch=1, pipeline_strategy="Backward")


def test_inconsistent_hand_made_plan_is_rejected():
    device = Device(0, 0, "/device:CPU:0")
    with pytest.raises(PlanError, match="device_count=2"):
        Plan(
            taskgraphs=(TaskGraph(0, "a", "replicate", 2),),
            num_replicas=1,
            devices_per_replica=2,
            placement=(((device,),),),
            num_micro_batch=1,
            worker_num=1,
            worker_index=0,
            colocate_split_and_replicate=False,
        )


def test_device_short_name_without_device_suffix():
    assert Device(1, 3, "weird").short_name == "w1:dev3"
    assert Device(0, 2, "/job:localhost/replica:0/task:0/device:GPU:2").short_name == "w0:GPU:2"
