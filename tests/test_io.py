"""IO slicing: the file-sharing rule, the per-worker tf.data pipeline and fit(files)."""

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

import epl_trainer as epl
from epl_trainer.training import io as io_lib


def _names(indices):
    return tuple(f"f{i}" for i in indices)


# (files, replicas per worker, option, expected indices per worker or None when slicing is
# turned off, dropped indices). Worker w owns `weight` consecutive slots of
# units = sum(weights); file i goes to slot i % units.
SLICING_TABLE = [
    pytest.param(8, [1, 1, 1, 1], None, [[0, 4], [1, 5], [2, 6], [3, 7]], [], id="8_on_4"),
    pytest.param(
        8, [1, 1, 1, 1], "unbalanced", [[0, 4], [1, 5], [2, 6], [3, 7]], [], id="8_on_4_unbal"
    ),
    pytest.param(
        10, [1, 1, 1, 1], "unbalanced", [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]], [], id="10_unbal"
    ),
    pytest.param(
        10, [1, 1, 1, 1], "drop_last", [[0, 4], [1, 5], [2, 6], [3, 7]], [8, 9], id="10_on_4_drop"
    ),
    pytest.param(10, [1, 1, 1, 1], None, None, [], id="10_on_4_off"),
    pytest.param(3, [1, 1, 1, 1], None, None, [], id="3_on_4_off"),
    pytest.param(3, [1, 1, 1, 1], "unbalanced", None, [], id="3_on_4_unbal_off"),
    pytest.param(3, [1, 1, 1, 1], "drop_last", None, [], id="3_on_4_drop_off"),
    pytest.param(8, [2, 2, 2, 2], None, [[0, 4], [1, 5], [2, 6], [3, 7]], [], id="gcd_2"),
    pytest.param(6, [2, 1], None, [[0, 1, 3, 4], [2, 5]], [], id="6_on_2+1"),
    pytest.param(6, [4, 2], None, [[0, 1, 3, 4], [2, 5]], [], id="6_on_4+2"),
    pytest.param(7, [2, 1], "unbalanced", [[0, 1, 3, 4, 6], [2, 5]], [], id="7_on_2+1_unbal"),
    pytest.param(7, [2, 1], "drop_last", [[0, 1, 3, 4], [2, 5]], [6], id="7_on_2+1_drop"),
    pytest.param(7, [1, 2], "unbalanced", [[0, 3, 6], [1, 2, 4, 5]], [], id="7_on_1+2_unbal"),
    pytest.param(2, [2, 1], None, None, [], id="2_on_2+1_off"),
    pytest.param(5, [3], None, [[0, 1, 2, 3, 4]], [], id="one_worker"),
]


@pytest.mark.parametrize("num_files, replicas, option, expected, dropped", SLICING_TABLE)
def test_slicing_rule(num_files, replicas, option, expected, dropped):
    files = _names(range(num_files))
    slices = io_lib.plan_slices(
        files,
        replicas,
        unbalanced_io_slicing=option == "unbalanced",
        drop_last_files=option == "drop_last",
    )
    assert slices.dropped == _names(dropped)
    if expected is not None:
        assert slices.sliced and slices.reason == ""
        assert slices.per_worker == tuple(_names(e) for e in expected)
        # A partition of the kept files: every file read by exactly one worker.
        read = [f for share in slices.per_worker for f in share]
        assert sorted(read) == sorted(set(files) - set(slices.dropped))
        return
    # Turned off: each worker reads every file, weight times, in its own order.
    assert not slices.sliced and slices.reason
    weights = [r // np.gcd.reduce(replicas) for r in replicas]
    for share, weight in zip(slices.per_worker, weights):
        assert sorted(share) == sorted(files * weight)


def test_turned_off_orders_differ_by_worker_and_are_reproducible():
    files = _names(range(10))
    first = io_lib.plan_slices(files, [1, 1, 1, 1])
    again = io_lib.plan_slices(files, [1, 1, 1, 1])
    assert first.per_worker == again.per_worker
    assert len(set(first.per_worker)) == 4
    other_seed = io_lib.plan_slices(files, [1, 1, 1, 1], seed=1)
    assert other_seed.per_worker != first.per_worker


def test_slice_files_warns_when_slicing_is_turned_off():
    with pytest.warns(UserWarning, match=r"IO slicing is turned off: 3 file\(s\) cannot be shared"):
        mine = io_lib.slice_files(
            list(_names(range(3))),
            worker_index=2,
            replicas_per_worker=[1, 1, 1, 1],
            unbalanced_io_slicing=False,
            drop_last_files=False,
        )
    assert sorted(mine) == list(_names(range(3)))
    with pytest.warns(UserWarning, match="io.unbalanced_io_slicing=True"):
        io_lib.slice_files(
            list(_names(range(10))),
            worker_index=0,
            replicas_per_worker=[1, 1, 1, 1],
            unbalanced_io_slicing=False,
            drop_last_files=False,
        )


def test_slice_files_returns_this_workers_share():
    mine = epl.io.slice_files(
        list(_names(range(10))),
        worker_index=1,
        replicas_per_worker=[1, 1, 1, 1],
        unbalanced_io_slicing=True,
        drop_last_files=False,
    )
    assert mine == list(_names([1, 5, 9]))


def test_slice_files_defaults_come_from_env_and_globs_are_sorted(tmp_path):
    for name in ["b.rec", "a.rec", "c.rec", "skip.txt"]:
        (tmp_path / name).write_text("x")
    # The test process is one worker: its share is the whole sorted list.
    mine = epl.io.slice_files(str(tmp_path / "*.rec"))
    assert mine == [str(tmp_path / n) for n in ["a.rec", "b.rec", "c.rec"]]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"files_or_glob": []}, ValueError, "file list is empty"),
        ({"files_or_glob": ["a", 3]}, TypeError, "must be a str"),
        ({"files_or_glob": 7}, TypeError, "glob pattern .* Received: int"),
        ({"files_or_glob": "/nonexistent/dir/*.rec"}, ValueError, "No file matches"),
        ({"worker_index": 4}, ValueError, r"worker_index must be in \[0, 4\)"),
        ({"replicas_per_worker": [1, 0]}, ValueError, r"Received: replicas_per_worker=\[1, 0\]"),
        (
            {"unbalanced_io_slicing": True, "drop_last_files": True},
            ValueError,
            "set at most one",
        ),
    ],
)
def test_slice_files_errors(kwargs, error, match):
    args = {
        "files_or_glob": list(_names(range(8))),
        "worker_index": 0,
        "replicas_per_worker": [1, 1, 1, 1],
        "unbalanced_io_slicing": False,
        "drop_last_files": False,
    }
    args.update(kwargs)
    with pytest.raises(error, match=match):
        io_lib.slice_files(args.pop("files_or_glob"), **args)


# ---- reading files --------------------------------------------------------------------


def write_tfrecords(directory, num_files, records_per_file, seed=0):
    """Files of tf.train.Example records {id, x[6], y}; returns (paths, x, y) in file order."""
    rng = np.random.default_rng(seed)
    n = num_files * records_per_file
    x = rng.normal(size=(n, 6)).astype("float32")
    y = rng.integers(0, 3, n)
    paths = []
    for f in range(num_files):
        path = str(directory / f"part-{f:03d}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for i in range(f * records_per_file, (f + 1) * records_per_file):
                example = tf.train.Example(
                    features=tf.train.Features(
                        feature={
                            "id": tf.train.Feature(int64_list=tf.train.Int64List(value=[i])),
                            "x": tf.train.Feature(float_list=tf.train.FloatList(value=x[i])),
                            "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[y[i]])),
                        }
                    )
                )
                writer.write(example.SerializeToString())
        paths.append(path)
    return paths, x, y


FEATURES = {
    "id": tf.io.FixedLenFeature([], tf.int64),
    "x": tf.io.FixedLenFeature([6], tf.float32),
    "y": tf.io.FixedLenFeature([], tf.int64),
}


def parse_example(record):
    parsed = tf.io.parse_single_example(record, FEATURES)
    return parsed["x"], parsed["y"]


def test_files_dataset_reads_tfrecord_and_text(tmp_path):
    paths, x, _ = write_tfrecords(tmp_path, 2, 5)
    batches = list(io_lib.files_dataset(paths, parse_example, 4))
    assert len(batches) == 2  # 10 records, partial batch dropped
    np.testing.assert_allclose(np.concatenate([b[0] for b in batches]), x[:8])
    lines = tmp_path / "lines.txt"
    lines.write_text("1\n2\n3\n")
    texts = io_lib.files_dataset(
        [str(lines)], lambda r: (tf.strings.to_number(r), r), 3, file_format="text"
    )
    np.testing.assert_allclose(next(iter(texts))[0], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=r"file_format must be one of .* file_format='csv'"):
        io_lib.files_dataset(paths, parse_example, 4, file_format="csv")


def _make_model():
    keras.utils.set_random_seed(0)
    inp = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu")(inp)
    return keras.Model(inp, keras.layers.Dense(3)(h))


def _trainer(model, config):
    return epl.EPLTrainer(
        model,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.optimizers.SGD(0.1),
        config=config,
    )


def test_fit_on_files_equals_fit_on_the_same_arrays(tmp_path):
    paths, x, y = write_tfrecords(tmp_path, 4, 8)
    config = {"cluster.virtual_devices": 2, "io.slicing": True}
    from_files = _make_model()
    _trainer(from_files, config).fit(
        str(tmp_path / "*.tfrecord"), parse_fn=parse_example, batch_size=8, verbose=0
    )
    from_arrays = _make_model()
    _trainer(from_arrays, config).fit(x, y, batch_size=8, verbose=0, shuffle=False)
    for a, b in zip(from_files.get_weights(), from_arrays.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert paths  # four files, one worker: its share is all of them


def test_fit_on_files_needs_a_parse_fn_and_no_labels(tmp_path):
    paths, _, y = write_tfrecords(tmp_path, 1, 4)
    trainer = _trainer(_make_model(), {"cluster.virtual_devices": 1})
    with pytest.raises(ValueError, match="needs x = file names or a glob, y=None and a parse_fn"):
        trainer.fit(paths, y, parse_fn=parse_example, verbose=0)
    with pytest.raises(ValueError, match="parse_fn=None, file_format='text'"):
        trainer.fit(paths, file_format="text", verbose=0)
    # Several workers: an epoch bounded by each worker's share could end unevenly.
    trainer.context.cluster = dataclasses.replace(trainer.cluster, worker_num=2)
    with pytest.raises(ValueError, match=r"needs steps_per_epoch .* worker_num=2"):
        trainer.fit(paths, parse_fn=parse_example, verbose=0)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_workers_each_read_only_their_files(tmp_path):
    """Under epl-launch, worker w parses exactly the records of files w and w + 2."""
    import json
    import os
    import subprocess
    import sys

    data = tmp_path / "data"
    data.mkdir()
    write_tfrecords(data, num_files=4, records_per_file=8)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    command = [
        sys.executable,
        "-m",
        "epl_trainer.runtime.launcher",
        "--num_workers",
        "2",
        "--gpu_per_worker",
        "2",
        "--log_dir",
        str(tmp_path / "logs"),
        os.path.join(root, "tests", "scripts", "train_io.py"),
        str(tmp_path / "out"),
        str(data / "*.tfrecord"),
        "--steps",
        "4",  # 4 steps x 4 records = the 16 records of a worker's two files
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPL_")}
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    result = subprocess.run(command, capture_output=True, text=True, timeout=200, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    seen = [json.loads((tmp_path / "out" / f"seen_{w}.json").read_text()) for w in range(2)]
    assert seen[0] == [*range(0, 8), *range(16, 24)]  # files 0 and 2
    assert seen[1] == [*range(8, 16), *range(24, 32)]  # files 1 and 3
    weights = [np.load(tmp_path / "out" / f"weights_{w}.npz") for w in range(2)]
    for key in weights[0]:
        np.testing.assert_array_equal(weights[0][key], weights[1][key])
