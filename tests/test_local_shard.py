"""The local tier's shard file read back as views (train/local_shard.py :func:`shard_views`): the same tensors as
safetensors' own loader, and a header that does not describe its data refused."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from train.local_shard import shard_views


def test_views_of_a_shard_equal_safetensors_own_load_for_every_dtype_and_shape():
    tensors = {"model0/w": torch.randn(3, 5), "optim0/state/0/0/exp_avg": torch.randn(7).to(torch.bfloat16),
               "optim0/scaler/scale": torch.tensor(65536.0, dtype=torch.float16), "steps": torch.arange(3),
               "mask": torch.tensor([True, False]), "empty": torch.empty(0, 4),
               "u8": torch.arange(5, dtype=torch.uint8)}
    blob = st_save(tensors)
    want, got = st_load(blob), shard_views(blob)
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), k
    # a received shard arrives as a uint8 array: the same views
    arr = torch.frombuffer(bytearray(blob), dtype=torch.uint8).numpy()
    assert all(torch.equal(shard_views(arr)[k], want[k]) for k in want)


def _with_header(blob: bytes, edit) -> bytes:
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + blob[8 + n:]


@pytest.mark.parametrize("edit, why", [
    (lambda h: h["w"].update(data_offsets=[0, 10 ** 9]), "does not describe its data"),
    (lambda h: h["w"].update(shape=[4, 4]), "does not describe its data"),
    (lambda h: h["w"].update(dtype="C64"), "does not describe its data"),
])
def test_a_header_that_does_not_describe_the_data_is_refused(edit, why):
    blob = _with_header(st_save({"w": torch.randn(2, 3)}), edit)
    with pytest.raises(ValueError, match=why):
        shard_views(blob)
    with pytest.raises(ValueError, match="header"):
        shard_views((10 ** 6).to_bytes(8, "little") + b"{}")
