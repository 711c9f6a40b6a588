"""What protects a checkpoint's bytes: the manifest's checksum, not torch.save's zip CRC32.

Checkpoint shards are written without the zip CRC32 (train/megatron_ckpt.py ``no_zip_crc32``: it cost
0.37 CPU-seconds per 1.6 GB save). These tests pin down why that loses nothing: torch.load never
checks the CRC, a file written without it loads back exactly, and a flipped byte in such a file is
still caught by the manifest (SHA-256) before anything loads it.
"""
from __future__ import annotations

import io

import pytest

torch = pytest.importorskip("torch")


def _flip_inside(raw: bytes, needle: bytes) -> bytes:
    i = raw.find(needle)
    assert i >= 0
    out = bytearray(raw)
    out[i] ^= 0xFF
    return bytes(out)


def test_torch_load_does_not_check_the_zip_crc32():
    t = torch.arange(1000, dtype=torch.float32)
    buf = io.BytesIO()
    torch.save(t, buf)  # with the CRC32 (torch's default)
    corrupt = _flip_inside(buf.getvalue(), t.numpy().tobytes()[400:416])
    loaded = torch.load(io.BytesIO(corrupt))  # no error: the CRC would have caught it, nobody checks it
    assert not torch.equal(loaded, t)


def test_no_zip_crc32_writes_loadable_files_and_restores_the_setting():
    from train.megatron_ckpt import no_zip_crc32

    t = torch.randn(64, 32)
    before = torch.serialization.get_crc32_options()
    with no_zip_crc32():
        assert torch.serialization.get_crc32_options() is False
        buf = io.BytesIO()
        torch.save({"w": t}, buf)
    assert torch.serialization.get_crc32_options() == before
    assert torch.equal(torch.load(io.BytesIO(buf.getvalue()))["w"], t)
    with pytest.raises(RuntimeError, match="inside"):
        with no_zip_crc32():
            raise RuntimeError("inside")
    assert torch.serialization.get_crc32_options() == before


def test_a_flipped_byte_in_a_shard_written_without_crc32_is_caught_by_the_manifest(tmp_path):
    from recovery.commit import commit, prepare_staging
    from recovery.resume import find_latest_verified, verify
    from train.megatron_ckpt import no_zip_crc32

    t = torch.randn(256)
    staging = prepare_staging(tmp_path, 5)
    with no_zip_crc32():
        torch.save({"w": t}, staging / "__0_0.distcp")
    path = commit(tmp_path, 5, {}, keep=1).path
    assert verify(path) is None
    shard = path / "__0_0.distcp"
    shard.write_bytes(_flip_inside(shard.read_bytes(), t.numpy().tobytes()[16:32]))
    assert not torch.equal(torch.load(shard)["w"], t)  # torch would load it
    assert verify(path).startswith("checksum mismatch __0_0.distcp: sha256")  # slurmtron does not
    assert find_latest_verified(tmp_path).path is None
