"""Checkpoints restore into any layout (DeepSpeed's "universal checkpoint").

Each resharding test trains half a run in one layout, saves, restores into a fresh
trainer of another layout (other device count, stage cut, ZeRO level, split width,
grouping) and finishes the run there. The result must equal the uninterrupted run of
the same steps to 1e-5: every layout computes the same mean-gradient update, so the only
differences are the order of float sums; a slot or step counter restored wrongly moves
the weights by far more (Adam's first step after a lost velocity moves each weight by
about the learning rate, 1e-2).
"""

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from _models import adam_trainer, max_weight_difference, mlp, mlp_data
from test_split import data as split_data
from test_split import head_model, split_trainer

from epl_trainer.training import checkpoint as ckpt
from epl_trainer.training.checkpoint import CheckpointError

ATOL = 1e-5
STAGES = {"dense_in": 0, "logits": 1}


def _resharded_run(tmp_path, make_first, make_second, make_model=mlp, data=mlp_data, epochs=2):
    """(uninterrupted model, resumed model, the checkpoint's manifest): `make_first`'s
    layout trains `epochs`, saves; `make_second`'s restores and trains `epochs` more (to
    epoch 2 * epochs: after a restore `epochs` is the final epoch)."""
    x, y = data()
    uninterrupted = make_model()
    make_first(uninterrupted).fit(x, y, batch_size=16, epochs=2 * epochs, verbose=0, shuffle=False)
    first = make_first(make_model())
    first.fit(x, y, batch_size=16, epochs=epochs, verbose=0, shuffle=False)
    path = first.save_checkpoint(str(tmp_path))
    resumed_model = make_model(seed=99)  # every value must come from the checkpoint
    resumed = make_second(resumed_model)
    assert resumed.restore_checkpoint(str(tmp_path)) == path
    assert int(resumed.optimizer.iterations.numpy()) == int(first.optimizer.iterations.numpy())
    history = resumed.fit(x, y, batch_size=16, epochs=2 * epochs, verbose=0, shuffle=False)
    assert history.epoch == list(range(epochs, 2 * epochs))
    manifest = json.loads((tmp_path / os.path.basename(path) / "manifest.json").read_text())
    print(
        f"max |resumed - uninterrupted| = {max_weight_difference(uninterrupted, resumed_model):.2e}"
    )
    return uninterrupted, resumed_model, manifest


@pytest.mark.combines("checkpoint+zero_v1+data_parallel", "checkpoint+pipeline")
def test_zero_v1_on_4_devices_restores_into_a_2_stage_pipeline_on_2(tmp_path):
    uninterrupted, resumed, manifest = _resharded_run(
        tmp_path,
        lambda m: adam_trainer(m, 4, **{"zero.level": "v1"}),
        lambda m: adam_trainer(m, 2, stages=STAGES),
    )
    assert max_weight_difference(uninterrupted, resumed) < ATOL
    assert manifest["layout"]["zero_level"] == "v1" and manifest["layout"]["lanes"] == 4
    # Adam's two slots of each of the 4 variables under the model's indices: whole, or
    # as the pieces ZeRO cut them into (each shard owns a quarter of the elements); the
    # pieces of a slot cover its elements once.
    entries = manifest["entries"]
    spans = {}
    for key in (k for k in entries if k.startswith("slot/")):
        base, _, span = key.partition("@elements=")
        size = int(np.prod(entries[key]["shape"]))
        start, stop = (int(e) for e in span.split(":")) if span else (0, size)
        assert size == stop - start
        spans.setdefault(base, []).append((start, stop))
    assert sorted(spans) == [f"slot/{i}/{n}" for i in range(4) for n in ("momentum", "velocity")]
    assert any(len(found) > 1 for found in spans.values())  # some variable was cut
    for found in spans.values():
        edges = [e for span in sorted(found) for e in span]
        assert edges[0] == 0 and edges[1:-1:2] == edges[2::2]
    velocity = [k for k in entries if k.startswith("slot/0/velocity")]
    assert all(entries[k]["name"].startswith("dense_in/kernel (velocity") for k in velocity)


@pytest.mark.combines("checkpoint+pipeline", "checkpoint+one_device")
def test_2_stage_pipeline_restores_into_1_device(tmp_path):
    uninterrupted, resumed, _ = _resharded_run(
        tmp_path,
        lambda m: adam_trainer(m, 2, stages=STAGES, **{"pipeline.num_micro_batch": 2}),
        lambda m: adam_trainer(m, 1),
    )
    assert max_weight_difference(uninterrupted, resumed) < ATOL


@pytest.mark.combines("checkpoint+one_device", "checkpoint+zero_v0+pipeline+data_parallel")
def test_1_device_restores_into_zero_v0_over_a_2_stage_pipeline_on_4(tmp_path):
    uninterrupted, resumed, _ = _resharded_run(
        tmp_path,
        lambda m: adam_trainer(m, 1),
        lambda m: adam_trainer(m, 4, stages=STAGES, **{"zero.level": "v0"}),
    )
    assert max_weight_difference(uninterrupted, resumed) < ATOL


@pytest.mark.combines("checkpoint+zero_v2+pipeline+data_parallel", "checkpoint+one_device")
def test_zero_v2_over_a_2_stage_pipeline_restores_into_1_device(tmp_path):
    """v2 holds the parameters only as pieces: they are saved gathered, as every layout's."""
    uninterrupted, resumed, manifest = _resharded_run(
        tmp_path,
        lambda m: adam_trainer(m, 4, stages=STAGES, **{"zero.level": "v2"}),
        lambda m: adam_trainer(m, 1),
    )
    assert max_weight_difference(uninterrupted, resumed) < ATOL
    assert manifest["layout"]["zero_level"] == "v2"


@pytest.mark.combines("checkpoint+one_device", "checkpoint+zero_v2+data_parallel")
def test_1_device_restores_into_zero_v2_on_4(tmp_path):
    uninterrupted, resumed, _ = _resharded_run(
        tmp_path,
        lambda m: adam_trainer(m, 1),
        lambda m: adam_trainer(m, 4, **{"zero.level": "v2", "pipeline.num_micro_batch": 2}),
    )
    assert max_weight_difference(uninterrupted, resumed) < ATOL


@pytest.mark.combines("checkpoint+split")
def test_split_width_4_restores_into_width_2(tmp_path):
    def data():
        return split_data()

    uninterrupted, resumed, manifest = _resharded_run(
        tmp_path,
        lambda m: split_trainer(m, 4, optimizer=keras.optimizers.Adam(0.01)),
        lambda m: split_trainer(m, 2, optimizer=keras.optimizers.Adam(0.01)),
        make_model=lambda seed=1: head_model(seed=seed),
        data=data,
        epochs=1,
    )
    assert max_weight_difference(uninterrupted, resumed) < ATOL
    assert manifest["layout"]["split_width"] == 4
    # The head's kernel and its slots are saved whole (16 x 8), not as 4 shards.
    head = [v.path for v in uninterrupted.trainable_variables].index("head/kernel")
    assert manifest["entries"][f"trainable/{head}"]["shape"] == [16, 8]
    assert manifest["entries"][f"slot/{head}/momentum"]["shape"] == [16, 8]


def test_grouped_apply_restores_into_plain_apply(tmp_path):
    uninterrupted, resumed, _ = _resharded_run(
        tmp_path,
        lambda m: adam_trainer(m, 2, **{"optimizer.num_apply_group": 2}),
        lambda m: adam_trainer(m, 2),
    )
    assert max_weight_difference(uninterrupted, resumed) < ATOL


@pytest.mark.combines("checkpoint+offload+data_parallel", "checkpoint+zero_v1+data_parallel")
def test_offload_restores_into_zero_v1(tmp_path):
    uninterrupted, resumed, _ = _resharded_run(
        tmp_path,
        lambda m: adam_trainer(m, 2, **{"offload.level": "v0"}),
        lambda m: adam_trainer(m, 4, **{"zero.level": "v1"}),
    )
    assert max_weight_difference(uninterrupted, resumed) < ATOL


# Slots are keyed by variable index and slot name whatever the optimizer
# (checkpoint_content.py), so three cover the paths: one slot per variable, three (Adam's
# two and amsgrad's maximum), and Lamb, whose variables ZeRO keeps whole. AdamW, Adagrad
# and Lion (one or two slots, cut like the others) were trimmed for the suite's time.
OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "lamb": lambda: keras.optimizers.Lamb(0.01),
    "adam_amsgrad": lambda: keras.optimizers.Adam(0.01, amsgrad=True),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.combines("checkpoint+zero_v1+data_parallel")
def test_every_optimizers_slots_move_from_zero_shards_to_groups(tmp_path, name):
    uninterrupted, resumed, manifest = _resharded_run(
        tmp_path,
        lambda m: adam_trainer(m, 4, OPTIMIZERS[name](), **{"zero.level": "v1"}),
        lambda m: adam_trainer(m, 2, OPTIMIZERS[name](), **{"optimizer.num_apply_group": 2}),
        epochs=1,
    )
    assert max_weight_difference(uninterrupted, resumed) < ATOL
    assert any(k.startswith("slot/3/") for k in manifest["entries"])


def test_a_checkpoint_of_another_optimizer_is_refused(tmp_path):
    x, y = mlp_data()
    first = adam_trainer(mlp(), 2)
    first.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    first.save_checkpoint(str(tmp_path))
    sgd = adam_trainer(mlp(), 2, keras.optimizers.SGD(0.1, momentum=0.9))
    with pytest.raises(CheckpointError, match=r"only in the checkpoint: \['dense_in/kernel \("):
        sgd.restore_checkpoint(str(tmp_path))


def test_checkpoint_in_an_in_memory_filesystem_restores_into_another_layout():
    """`checkpoint.dir` may be any tf.io.gfile path; ram:// has no folder rename, as object
    stores (gs://) have none: the files move one by one, the manifest last."""
    directory = "ram://universal_ckpt_test"
    x, y = mlp_data()
    uninterrupted = mlp()
    adam_trainer(uninterrupted, 2).fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    first = adam_trainer(mlp(), 2)
    first.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    path = first.save_checkpoint(directory, keep_max=1)
    assert path == directory + "/ckpt-4"
    assert tf.io.gfile.exists(path + "/manifest.json")
    resumed_model = mlp(seed=5)
    resumed = adam_trainer(resumed_model, 4, **{"zero.level": "v1"})
    resumed.restore_checkpoint(directory)
    resumed.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    assert max_weight_difference(uninterrupted, resumed_model) < ATOL
    resumed.save_checkpoint(directory, keep_max=1)
    assert sorted(tf.io.gfile.listdir(directory)) == ["ckpt-8", "latest"]
    tf.io.gfile.rmtree(directory)


class _Crash(Exception):
    pass


def test_a_crash_between_the_shards_and_the_manifest_keeps_the_previous_latest(
    tmp_path, monkeypatch
):
    x, y = mlp_data()
    trainer = adam_trainer(mlp(), 2)
    trainer.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    trainer.save_checkpoint(str(tmp_path))
    trainer.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)

    def crash(folder):
        assert sorted(os.listdir(folder))[:2] == ["manifest.json", "shard-0.bin"]
        raise _Crash()

    monkeypatch.setattr(ckpt, "before_publish", crash)
    with pytest.raises(_Crash):
        trainer.save_checkpoint(str(tmp_path))
    assert (tmp_path / "latest").read_text() == "ckpt-4"
    assert not (tmp_path / "ckpt-8").exists()
    restored = adam_trainer(mlp(seed=3), 2)
    assert restored.restore_checkpoint(str(tmp_path)).endswith("ckpt-4")
    assert int(restored.optimizer.iterations.numpy()) == 4


def test_a_missing_shard_is_never_published(tmp_path):
    """The chief's check once the barrier passed: a job of 2 workers where only worker
    0's shard is in the folder (worker 1's disk failed) publishes nothing."""
    directory = str(tmp_path)
    ckpt.prepare(directory)
    folder = ckpt.temporary_folder(directory, 6, os.getpid())
    ckpt.write_shard(folder, 0, [("trainable/0", "w", tf.ones([2]))])
    with pytest.raises(CheckpointError, match=r"Shard 1 of '.*\.tmp-ckpt-6-\d+' is incomplete: "):
        ckpt.publish(directory, folder, 6, 2, {}, ["trainable/0"])
    assert not ckpt.exists(directory) and ckpt.list_checkpoints(directory) == []


def test_a_shard_that_fails_to_write_stops_the_save_and_names_it(tmp_path, monkeypatch):
    x, y = mlp_data()
    trainer = adam_trainer(mlp(), 1)
    trainer.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    trainer.save_checkpoint(str(tmp_path))

    def full_disk(folder, worker, entries, *staging_and_inputs):
        raise OSError(f"No space left on device: {folder}")

    monkeypatch.setattr(ckpt, "write_shard", full_disk)
    trainer.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    with pytest.raises(OSError, match=r"No space left on device: .*\.tmp-ckpt-8-"):
        trainer.save_checkpoint(str(tmp_path))
    assert (tmp_path / "latest").read_text() == "ckpt-4"


def test_restore_reads_only_the_shards_its_entries_are_in(tmp_path):
    """A 2-shard checkpoint (as 2 workers write it) whose shard 1 holds only entries this
    reader does not need: it is neither opened nor size-checked."""
    directory = str(tmp_path)
    ckpt.prepare(directory)
    folder = ckpt.temporary_folder(directory, 3, os.getpid())
    ckpt.write_shard(folder, 0, [("trainable/0", "a", tf.fill([2], 5.0))])
    ckpt.write_shard(folder, 1, [("slot/0/momentum", "a (momentum)", tf.ones([2]))])
    path = ckpt.publish(directory, folder, 3, 2, {}, ["trainable/0"])
    with open(os.path.join(path, "shard-1.bin"), "r+b") as f:
        f.truncate(1)
    manifest = ckpt.read_manifest(path)
    needed = {"trainable/0": _Expected("a", [2], "float32")}
    values = ckpt.read_entries(path, manifest, needed)
    np.testing.assert_array_equal(values["trainable/0"], [5.0, 5.0])
    needed["slot/0/momentum"] = _Expected("a (momentum)", [2], "float32")
    with pytest.raises(CheckpointError, match=r"shard-1\.bin' is truncated"):
        ckpt.read_entries(path, manifest, needed)


def test_a_worker_that_owns_nothing_writes_an_empty_shard(tmp_path):
    """Data parallelism over 2 workers: lane 0's worker owns every entry, the other's shard
    is empty (only its record is written)."""
    directory = str(tmp_path)
    ckpt.prepare(directory)
    folder = ckpt.temporary_folder(directory, 2, os.getpid())
    ckpt.write_shard(folder, 1, [])
    ckpt.write_shard(folder, 0, [("trainable/0", "a", tf.fill([2], 5.0))])
    path = ckpt.publish(directory, folder, 2, 2, {}, ["trainable/0"])
    assert sorted(os.listdir(path)) == [
        "manifest.json",
        "shard-0.bin",
        "shard-0.json",
        "shard-1.json",
    ]
    manifest = ckpt.read_manifest(path)
    assert manifest["shards"]["shard-1"] == {"files": {}}
    values = ckpt.read_entries(path, manifest, {"trainable/0": _Expected("a", [2], "float32")})
    np.testing.assert_array_equal(values["trainable/0"], [5.0, 5.0])


class _Expected:
    def __init__(self, name, shape, dtype):
        self.name, self.shape, self.dtype, self.optional = name, shape, dtype, False


def _adafactor_trainer(model, devices, **config):
    return adam_trainer(model, devices, keras.optimizers.Adafactor(0.01), **config)


def _assert_factored_entries(manifest):
    """dense_in/kernel (6, 16): its row moment drops the last axis, its column moment the
    second last; 1-D variables keep Adafactor's unfactored velocity only."""
    entries = manifest["entries"]
    assert entries["slot/0/velocity_row"]["shape"] == [6]
    assert entries["slot/0/velocity_col"]["shape"] == [16]
    assert entries["slot/0/velocity_col"]["name"] == "dense_in/kernel (velocity_col)"
    assert entries["slot/1/velocity"]["shape"] == [16]
    assert "slot/1/velocity_row" not in entries


def test_adafactor_checkpoint_continues_like_the_uninterrupted_run_on_2_devices(tmp_path):
    """Adafactor's factored moments (made with `add_variable`, shaped unlike the variable)
    are saved and restored: a lost row / column moment moves the weights by ~1e-3."""
    uninterrupted, resumed, manifest = _resharded_run(
        tmp_path, lambda m: _adafactor_trainer(m, 2), lambda m: _adafactor_trainer(m, 2)
    )
    assert max_weight_difference(uninterrupted, resumed) < 1e-6
    _assert_factored_entries(manifest)


@pytest.mark.combines("checkpoint+zero_v1+data_parallel")
def test_adafactor_checkpoint_under_zero_v1_continues_like_the_uninterrupted_run(tmp_path):
    """ZeRO gives Adafactor's variables whole to one replica (its update is not
    element-wise): the owner writes their factored moments and restores them."""
    uninterrupted, resumed, manifest = _resharded_run(
        tmp_path,
        lambda m: _adafactor_trainer(m, 2, **{"zero.level": "v1"}),
        lambda m: _adafactor_trainer(m, 2, **{"zero.level": "v1"}),
    )
    assert max_weight_difference(uninterrupted, resumed) < 1e-6
    _assert_factored_entries(manifest)
    assert not any("@elements=" in key for key in manifest["entries"])


def test_adafactor_checkpoint_of_a_split_variable_is_refused_naming_the_alternative(tmp_path):
    """Each split shard factors its own columns (its row moment is not the whole
    kernel's), so no join gives the whole variable's moments: refused, nothing written."""
    x, y = split_data()
    trainer = split_trainer(head_model(), 2, optimizer=keras.optimizers.Adafactor(0.01))
    trainer.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    with pytest.raises(ValueError, match=r"Adafactor's factored moments of a split variable"):
        trainer.save_checkpoint(str(tmp_path))
    assert not ckpt.exists(str(tmp_path))
