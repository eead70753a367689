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
    assert all(r["offset"] % shard_file.ALIGN == 0 for r in records)  # copied whole
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


def _large_arrays():
    """Arrays written from their own memory: several pages, at addresses inside a page
    (a slice of a larger buffer) and at a page's start, with partial pages at both ends."""
    base = np.arange(70_000, dtype=np.float32)
    inside_a_page = base[3:]  # 12 bytes past an allocation's start: never on a page
    assert inside_a_page.ctypes.data % shard_file.ALIGN != 0
    page = shard_file.StagingBuffer().view(20 * shard_file.ALIGN)  # page-aligned
    at_a_page = np.frombuffer(page, dtype=np.int32)[: 20 * 1024 - 5]
    at_a_page[:] = np.arange(at_a_page.size)
    return [inside_a_page, ARRAYS[0], at_a_page, np.float64(-2.5) * np.ones(9000)]


@pytest.mark.parametrize("folder", ["disk", "tmpfs"])
def test_large_entries_are_written_from_their_own_memory(tmp_path, folder):
    """Only the partial pages at a large entry's ends pass through the staging buffer
    (a whole copy cost 13 ms of CPU per 126 MB save on the writer's thread, beside the
    step); every byte reads back and each entry's region starts on a page."""
    if folder == "tmpfs":
        if not os.path.isdir("/dev/shm"):
            pytest.skip("needs a tmpfs at /dev/shm")
        tmp_path = tmp_path.__class__(f"/dev/shm/epl_shard_{os.getpid()}")
        tmp_path.mkdir(exist_ok=True)
    try:
        arrays = _large_arrays()
        path = str(tmp_path / "shard-0.bin")
        staging = shard_file.StagingBuffer()
        records = shard_file.write(path, arrays, staging)
        assert staging.nbytes <= 8 * shard_file.ALIGN  # two pages per large entry at most
        assert sum(a.nbytes for a in arrays) > 100 * shard_file.ALIGN
        # Where it sits in its page, so that its whole pages land on aligned offsets.
        assert records[0]["offset"] % shard_file.ALIGN == arrays[0].ctypes.data % shard_file.ALIGN
        entries = {
            str(i): {**r, "shape": list(a.shape), "dtype": a.dtype.name, "name": f"a{i}"}
            for i, (a, r) in enumerate(zip(arrays, records))
        }
        values = shard_file.read(path, entries)
        for i, array in enumerate(arrays):
            np.testing.assert_array_equal(values[str(i)], array)
        assert os.path.getsize(path) % shard_file.ALIGN == 0
    finally:
        if folder == "tmpfs":
            for name in os.listdir(tmp_path):
                os.remove(tmp_path / name)
            os.rmdir(tmp_path)


@pytest.mark.skipif(not shard_file._O_DIRECT, reason="O_DIRECT is Linux's")
def test_a_device_refusing_the_alignment_gets_the_rest_through_the_page_cache(
    tmp_path, monkeypatch
):
    """A disk whose blocks are larger than a page refuses an O_DIRECT write (EINVAL): the
    file's rest is written through the page cache and synced, not lost."""
    import errno
    import fcntl

    real_pwrite, refused = os.pwrite, []

    def pwrite(descriptor, data, offset):
        if fcntl.fcntl(descriptor, fcntl.F_GETFL) & shard_file._O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(descriptor, data, offset)

    monkeypatch.setattr(shard_file.os, "pwrite", pwrite)
    arrays = _large_arrays()
    path = str(tmp_path / "shard-0.bin")
    records = shard_file.write(path, arrays, shard_file.StagingBuffer())
    assert refused == [0]  # once: the descriptor then writes without O_DIRECT
    entries = {
        str(i): {**r, "shape": list(a.shape), "dtype": a.dtype.name, "name": f"a{i}"}
        for i, (a, r) in enumerate(zip(arrays, records))
    }
    for i, value in shard_file.read(path, entries).items():
        np.testing.assert_array_equal(value, arrays[int(i)])
