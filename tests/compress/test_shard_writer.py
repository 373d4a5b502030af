"""ShardWriter: tensors land at their offsets, a full disk is reported by name, nothing partial survives."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from safetensors.torch import load_file

from kvq.checkpoint.header import TensorInfo
from kvq.checkpoint.write import tmp_path as temporary
from kvq.compress import shard_files
from kvq.compress.safetensors_layout import shard_layout
from kvq.compress.shard_writer import ShardWriter
from kvq.compress.tensor_plan import OutputTensor
from kvq.compress.torch_quantize import read_tensor, tensor_bytes
from kvq.errors import KvqError

TENSORS = {
    "b.weight": torch.randn(5, 3).bfloat16(),
    "a.weight_packed": torch.randint(0, 9, (4, 2), dtype=torch.int32),
}


def layout():
    return shard_layout(
        [OutputTensor("b.weight", "BF16", (5, 3)), OutputTensor("a.weight_packed", "I32", (4, 2))]
    )


def test_written_file_loads_back(tmp_path):
    path = tmp_path / "model.safetensors"
    with ShardWriter.create(path, layout()) as writer:
        for name, tensor in TENSORS.items():
            writer.write(name, tensor_bytes(tensor))
        size, sha = writer.commit()
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors.kvq-tmp"]  # until the parent publishes it
    shard_files.publish(path)
    assert size == path.stat().st_size and len(sha) == 64
    assert all(torch.equal(load_file(path)[n], t) for n, t in TENSORS.items())
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]


@pytest.mark.parametrize("failing", ["pwrite", "posix_fallocate"])
def test_disk_full_names_the_file_and_leaves_nothing(tmp_path, monkeypatch, failing):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shard_files.os, failing, full)
    path = tmp_path / "model-00002-of-00003.safetensors"
    with pytest.raises(
        KvqError,
        match=r"model-00002-of-00003.safetensors: disk full while .*No space left on "
        r"device.* free space on .* re-run the same command to resume",
    ):
        with ShardWriter.create(path, layout()) as writer:
            for name, tensor in TENSORS.items():
                writer.write(name, tensor_bytes(tensor))
            writer.commit()
    assert os.listdir(tmp_path) == []


def test_an_error_mid_shard_removes_the_temporary_file(tmp_path):
    path = tmp_path / "model.safetensors"
    with pytest.raises(RuntimeError), ShardWriter.create(path, layout()) as writer:
        writer.write("b.weight", tensor_bytes(TENSORS["b.weight"]))
        raise RuntimeError("worker failed")
    assert os.listdir(tmp_path) == []


def test_commit_refuses_a_shard_with_missing_tensors(tmp_path):
    with (
        pytest.raises(AssertionError, match="never written"),
        ShardWriter.create(tmp_path / "m.safetensors", layout()) as w,
    ):
        w.write("b.weight", tensor_bytes(TENSORS["b.weight"]))
        w.commit()
    assert os.listdir(tmp_path) == []


def test_read_tensor_reports_a_cut_short_shard(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"\0" * 10)
    with pytest.raises(KvqError, match="x.bin: tensor 't' is cut short .* truncated"):
        read_tensor(TensorInfo("t", path, "F32", (4,), 0, 16))


def test_parts_written_by_separate_writers_make_the_same_file(tmp_path):
    whole, parted = tmp_path / "a" / "model.safetensors", tmp_path / "b" / "model.safetensors"
    whole.parent.mkdir(), parted.parent.mkdir()
    with ShardWriter.create(whole, layout()) as writer:
        for name, tensor in TENSORS.items():
            writer.write(name, tensor_bytes(tensor))
        expected = writer.commit()
    shard_files.create_shard_file(parted, layout())
    for name, tensor in reversed(TENSORS.items()):  # one part per tensor, in any order
        with ShardWriter.part(parted, layout().subset([name]), [name]) as part:
            part.write(name, tensor_bytes(tensor))
            part.close()
    assert (len(temporary(parted).read_bytes()), shard_files.commit_shard_file(parted)) == expected
    assert temporary(parted).read_bytes() == temporary(whole).read_bytes()


def test_a_failing_part_leaves_the_file_to_its_parent(tmp_path):
    path = tmp_path / "model.safetensors"
    shard_files.create_shard_file(path, layout())
    with pytest.raises(RuntimeError), ShardWriter.part(path, layout(), ["b.weight"]):
        raise RuntimeError("worker failed")
    assert os.listdir(tmp_path) == ["model.safetensors.kvq-tmp"]  # the run removes it, with its other parts
