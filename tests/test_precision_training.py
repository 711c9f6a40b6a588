"""Real Megatron-Core training in bf16 and in fp16 with dynamic loss scaling, on the CPU (one rank each).

The fp16 run gets two injected overflows (``SLURMTRON_TEST_OVERFLOW_AT_ITER=3,4``: every gradient
of those iterations is set to inf after the backward pass) and shows Megatron's dynamic loss scaler
at work: both updates are skipped and counted in the log line, the scale holds after the first
overflow (``hysteresis=2``), halves after the second, and doubles again after ``loss_scale_window``
clean steps; each overflow is a WARNING line and an event. fp8 needs TransformerEngine and is
refused at worker start (tests/test_versions.py).
"""
from __future__ import annotations

import math
import re
from typing import Dict

import pytest

from trainutil import RunResult, train

pytestmark = pytest.mark.training

ITERS = 10
BASE = ["parallelism=tp1", f"training.train_iters={ITERS}", "training.checkpoint_interval=100"]
RUNS = {
    "bf16": (["training.precision=bf16"], {}),
    "fp16": (["training.precision=fp16", "training.initial_loss_scale=65536", "training.hysteresis=2",
              "training.loss_scale_window=3"], {"SLURMTRON_TEST_OVERFLOW_AT_ITER": "3,4"}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache: Dict[str, RunResult] = {}
    root = tmp_path_factory.mktemp("precision")

    def get(name: str) -> RunResult:
        if name not in cache:
            overrides, env = RUNS[name]
            res = train(root / name, BASE + overrides, world=1, timeout=300, extra_env=env)
            assert res.codes == [0], f"{name} exited {res.codes}\n{res.all_logs()}"
            cache[name] = res
        return cache[name]

    return get


def _iteration_lines(res: RunResult) -> Dict[int, dict]:
    out = {}
    for m in re.finditer(r"iteration +(\d+)/ +\d+ \|.*?lm loss: (\S+) \| loss scale: (\S+) \|.*?"
                         r"number of skipped iterations: +(\d+)", res.log()):
        out[int(m.group(1))] = {"loss": float(m.group(2)), "scale": float(m.group(3)), "skipped": int(m.group(4))}
    return out


def _checkpoint_dtype(res: RunResult, key: str):
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(res.run_dir / "checkpoints" / f"iter_{ITERS:07d}")).read_metadata()
    return md.state_dict_metadata[key].properties.dtype


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_loss_falls_in_half_precision(runs, name):
    import torch

    res = runs(name)
    losses = [res.losses[s] for s in sorted(res.losses)]
    assert len(losses) == ITERS and all(math.isfinite(x) for x in losses)
    assert max(losses[-3:]) < losses[0] - 0.2, losses
    # the model really trained in that precision; Adam's main weights stay fp32 (Megatron's mixed precision)
    want = {"bf16": torch.bfloat16, "fp16": torch.float16}[name]
    assert _checkpoint_dtype(res, "decoder.layers.self_attention.linear_qkv.weight") == want
    assert _checkpoint_dtype(res, "optimizer.state.param.decoder.layers.self_attention.linear_qkv.weight") \
        == torch.float32


def test_fp16_overflows_skip_the_step_and_move_the_loss_scale(runs):
    res = runs("fp16")
    lines = _iteration_lines(res)
    assert sorted(lines) == list(range(1, ITERS + 1))
    assert [lines[i]["skipped"] for i in range(1, ITERS + 1)] == [0, 0, 1, 2, 2, 2, 2, 2, 2, 2]
    scales = [lines[i]["scale"] for i in range(1, ITERS + 1)]
    # 2 overflows in a row (hysteresis 2) halve it; 3 clean steps (loss_scale_window) double it again
    assert scales == [65536.0] * 3 + [32768.0] * 3 + [65536.0] * 3 + [131072.0], scales
    log = res.log()
    assert log.count("WARNING: fp16 loss scale overflow at iteration") == 2
    assert "WARNING: fp16 loss scale overflow at iteration 3: the update was skipped" in log
    overflow = [(e["step"], e["loss_scale"]) for e in res.events if e["event"] == "loss_scale_overflow"]
    assert overflow == [(3, 65536.0), (4, 32768.0)]
    assert not [e for e in res.events if e["event"] == "nan"]  # an overflow is not a NaN incident
    bf16 = runs("bf16")
    assert _iteration_lines(bf16)[ITERS]["scale"] == 1.0 and _iteration_lines(bf16)[ITERS]["skipped"] == 0
