"""Hugging Face export and import on real training (CPU, gloo, the tiny model), two 4-rank runs in all:

1. TP2 x DP2 trains 3 steps (checkpoints at 2 and 3); ``python -m train.export --step 2`` writes it as an HF model;
2. TP2 x PP2 starts from that HF model (``training.init_from=hf:``) and trains 2 steps; its export is checked too.

Each export is loaded with ``transformers`` here and its logits compared with the Megatron model's own forward
(tests/megatron_logits.py) on the same tokens: float32, max abs difference <= 1e-4 (measured ~1e-6), greedy tokens
equal. Every document of the training data is the same 64 tokens (one sample each), so every step sees the same
batch: run 2's first-step loss (the HF weights) must equal run 1's step-3 loss (its step-2 weights) to 1e-5
relative (a layout changes the float32 summation order: ~1e-7 measured).
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from datafiles import write_docs
from trainutil import REPO, train

pytestmark = pytest.mark.training

LOGITS_TOL = 1e-4
LOSS_REL = 1e-5
COMMON = ["model=tiny", "data=indexed", "training.clip_grad=10.0", "training.async_save=false"]


def export(run_dir: Path, out: Path, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "train.export", str(run_dir), "--out", str(out), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    return json.loads((out / "slurmtron_export.json").read_text())


def hf_logits(hf_dir: Path, tokens: np.ndarray) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.from_numpy(tokens)).logits.float().numpy()


def assert_readable_and_decodable(hf_dir: Path, record: dict) -> None:
    """The export's files are readable by the group (the mode open() gives under the umask the export ran with), its
    vocabulary is the tokenizer's, and greedy generation only yields ids the tokenizer decodes."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    from launch.tokenizer import ByteTokenizer

    umask = os.umask(0o022)
    os.umask(umask)
    files = sorted(p for p in hf_dir.iterdir() if p.is_file())
    assert {"model.safetensors", "config.json", "slurmtron_vocab_padding.safetensors"} <= {p.name for p in files}
    for p in files:
        assert p.stat().st_mode & 0o777 == 0o666 & ~umask, (p.name, oct(p.stat().st_mode))
    tok = ByteTokenizer()
    assert json.loads((hf_dir / "config.json").read_text())["vocab_size"] == tok.vocab_size == record["vocab_size"]
    assert record["padded_vocab_size"] == 320
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    assert model.get_input_embeddings().weight.shape[0] == model.get_output_embeddings().weight.shape[0] == 257
    prompt = torch.tensor([tok.tokenize("Hello")])
    out = model.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=tok.eod)[0].tolist()
    assert len(out) > prompt.shape[1] and all(i in tok.inv_vocab for i in out), out


def test_export_to_hf_and_start_a_run_from_it(tmp_path):
    rng = np.random.default_rng(0)
    doc = rng.integers(0, 256, size=64, dtype=np.uint16)  # seq_length tokens: every sample is this document
    prefix = write_docs(tmp_path / "data" / "same", [doc] * 400)
    data = [f"data.path={prefix}"]

    src = train(tmp_path / "tp2_dp2", [*COMMON, *data, "parallelism=tp2", "training.train_iters=3",
                                       "training.checkpoint_interval=2"], world=4, timeout=600)
    assert src.codes == [0] * 4, src.all_logs()
    rec1 = export(src.run_dir, tmp_path / "hf_tp2_dp2", "--step", "2")
    assert rec1["step"] == 2 and rec1["dtype"] == "float32" and rec1["logits"]["greedy_equal"]

    hf1 = tmp_path / "hf_tp2_dp2"
    assert_readable_and_decodable(hf1, rec1)
    dst = train(tmp_path / "tp2_pp2", [*COMMON, *data, "parallelism=tp2_pp2", f"training.init_from=hf:{hf1}",
                                       "training.train_iters=2", "training.checkpoint_interval=100"],
                world=4, timeout=600)
    assert dst.codes == [0] * 4, dst.all_logs()
    assert [e["source"] for e in dst.events if e["event"] == "init_from"] == [str(hf1)]
    # the same batch, the same weights, another layout: the same loss
    assert math.isclose(dst.losses[1], src.losses[3], rel_tol=LOSS_REL), (dst.losses, src.losses)
    assert not math.isclose(src.losses[1], src.losses[3], rel_tol=1e-3)  # the weights did change in between
    rec2 = export(dst.run_dir, tmp_path / "hf_tp2_pp2")
    assert rec2["step"] == 2 and rec2["trained_layout"].startswith("tp2-pp2")

    ref = tmp_path / "megatron.npz"
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "megatron_logits.py"), str(ref),
                           f"{src.run_dir}:2", f"{dst.run_dir}:2"], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    arrays = np.load(ref, allow_pickle=False)
    for name, hf_dir in (("tp2_dp2", hf1), ("tp2_pp2", tmp_path / "hf_tp2_pp2")):
        tokens, megatron = arrays[f"{name}_tokens"], arrays[f"{name}_logits"]
        ours = hf_logits(hf_dir, tokens)
        assert ours.shape == (*tokens.shape, 257) and megatron.shape == (*tokens.shape, 320)  # the padding is cut
        megatron = megatron[..., :257]
        diff = float(np.abs(ours - megatron).max())
        assert diff <= LOGITS_TOL, (name, diff)
        assert (ours.argmax(-1) == megatron.argmax(-1)).all(), name
