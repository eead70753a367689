"""Raw checkpoint shard files (shard_file.py): what is written is read back, bit for bit,
on disks with O_DIRECT and on tmpfs without it; a changed byte is caught by the hash."""

import os

import numpy as np
import pytest
import tensorflow as tf

from epl_trainer.training import shard_file

ARRAYS = [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.array(7, dtype=np.int64),  # a scalar (optimizer/iterations)
    np.zeros((0, 5), dtype=np.float32),  # no elements
    np.array([True, False, True]),
    np.linspace(-1, 1, 5000).astype(tf.bfloat16.as_numpy_dtype),  # not a multiple of 4 KiB
    np.full((2, 3), 1.5, dtype=np.float16),
]


def _roundtrip(folder):
    path = os.path.join(folder, "shard-0.bin")
    staging = shard_file.StagingBuffer()
    records = shard_file.write(path, ARRAYS, staging)
    entries = {
        str(i): {**record, "shape": list(a.shape), "dtype": a.dtype.name, "name": f"a{i}"}
        for i, (a, record) in enumerate(zip(ARRAYS, records))
    }
    assert all(r["offset"] % shard_file.ALIGN == 0 for r in records)
    assert os.path.getsize(path) % shard_file.ALIGN == 0
    values = shard_file.read(path, entries)
    for i, array in enumerate(ARRAYS):
        assert values[str(i)].dtype == array.dtype
        np.testing.assert_array_equal(values[str(i)], array)
    return path, entries


def test_a_shard_reads_back_what_was_written(tmp_path):
    _roundtrip(str(tmp_path))


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs a tmpfs at /dev/shm")
def test_a_file_system_without_o_direct_gets_an_ordinary_write(tmp_path):
    folder = f"/dev/shm/epl_shard_{os.getpid()}"
    os.makedirs(folder, exist_ok=True)
    try:
        _roundtrip(folder)
    finally:
        for name in os.listdir(folder):
            os.remove(os.path.join(folder, name))
        os.rmdir(folder)


def test_a_changed_byte_is_caught_by_the_hash(tmp_path):
    path, entries = _roundtrip(str(tmp_path))
    with open(path, "r+b") as f:
        f.seek(entries["0"]["offset"] + 5)
        f.write(b"\xff")
    with pytest.raises(shard_file.ShardFileError, match=r"'a0' .* does not match the hash"):
        shard_file.read(path, entries)


def test_a_non_numeric_entry_is_refused(tmp_path):
    with pytest.raises(TypeError, match=r"numeric or bool\. Received: dtype object"):
        shard_file.write(
            str(tmp_path / "s.bin"), [np.array(["a"], dtype=object)], shard_file.StagingBuffer()
        )
