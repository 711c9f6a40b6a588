"""TensorBoard and W&B from a real Megatron-Core run that crashes and is restarted from its checkpoint:
read back with TensorBoard's own ``EventAccumulator``, one point per step, no duplicates."""
from __future__ import annotations

import json

import pytest

from test_tracking import wandb_history
from trainutil import train

pytestmark = pytest.mark.training

ITERS = 8
BASE = [f"training.train_iters={ITERS}", "training.checkpoint_interval=4", "training.clip_grad=10.0",
        "parallelism=tp1", "tracking.wandb=true",
        "training.async_save=false"]  # the step-4 checkpoint is durable before the crash at step 7


def test_tensorboard_and_wandb_continue_across_a_restart(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    env = {"WANDB_SILENT": "true", "WANDB_MODE": "offline"}
    first = train(run, BASE, world=1, attempt=0, timeout=300, extra_env={**env, "SLURMTRON_TEST_FAIL_AT_ITER": "7"})
    assert first.codes != [0]  # crashed at step 7, after the checkpoint at step 4 and the log of steps 1..6
    assert sorted(first.losses) == list(range(1, 7))
    second = train(run, BASE, world=1, attempt=1, timeout=300, extra_env=env)
    assert second.codes == [0], second.all_logs()

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    loss = acc.Scalars("lm loss")
    assert [e.step for e in loss] == list(range(1, ITERS + 1))  # steps 5, 6 were redone: shown once
    assert [round(e.value, 5) for e in loss] == [round(second.losses[s], 5) for s in range(1, ITERS + 1)]
    tags = set(acc.Tags()["scalars"])
    assert {"learning-rate", "grad-norm", "loss-scale", "iteration-time", "tokens-per-sec", "batch-size",
            "mem-rss-bytes"} <= tags
    assert "mfu" not in tags  # a CPU run has no accelerator peak
    texts = [bytes(t.tensor_proto.string_val[0]).decode() for t in acc.Tensors("events/text_summary")]
    assert any("checkpoint_saved" in t and "step=4" in t for t in texts), texts
    assert any("attempt 1 (job local) starts at step 5" in t for t in texts), texts

    run_id = (run / "wandb_id").read_text().strip()
    offline = sorted((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all((d / f"run-{run_id}.wandb").is_file() for d in offline)
    # W&B's step is the iteration; offline, the resumed attempt cannot rewind: it re-logs 5, 6 and says so once
    for d, attempt, steps in ((offline[0], first, range(1, 7)), (offline[1], second, range(5, ITERS + 1))):
        rows = [r for r in wandb_history(d) if "lm loss" in r]
        assert [r["_step"] for r in rows] == list(steps)
        assert [round(r["lm loss"], 5) for r in rows] == [round(attempt.losses[s], 5) for s in steps]
    events = [json.loads(ln) for ln in (run / "events.jsonl").read_text().splitlines()]
    fallback = [e for e in events if e["event"] == "tracking_fallback"]
    assert len(fallback) == 1 and fallback[0]["step"] == 4 and fallback[0]["mode"] == "offline"
    logs = "".join(p.read_text(errors="replace") for p in sorted((run / "logs").glob("*.out")))
    assert logs.count("WARNING: tracking.wandb: W&B offline mode cannot rewind") == 1
    assert "failed on" not in logs  # every writer call (and W&B's finish) succeeded


def test_validation_loss_falls_on_the_indexed_dataset_and_reaches_the_report(tmp_path):
    import subprocess
    import sys

    from test_training import _corpus
    from trainutil import REPO

    from analysis import report

    _corpus(tmp_path / "corpus.jsonl")
    prefix = tmp_path / "data" / "corpus"
    proc = subprocess.run([sys.executable, "-m", "launch.preprocess", "--input", str(tmp_path / "corpus.jsonl"),
                           "--output-prefix", str(prefix)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    run = tmp_path / "run"
    res = train(run, ["training.train_iters=12", "training.checkpoint_interval=100", "training.clip_grad=10.0",
                      "parallelism=tp1", "data=indexed", f"data.path={prefix}", "data.split='90,10,0'",
                      "training.eval_interval=4", "training.eval_iters=2", "tracking.tensorboard=false"],
                world=1, timeout=300)
    assert res.codes == [0], res.all_logs()
    vals = {e["step"]: float(e["loss"]) for e in res.events if e["event"] == "validation"}
    assert sorted(vals) == [4, 8, 12]
    assert vals[12] < vals[4] - 0.2, vals  # held-out bytes of the same kind of English: the model generalises
    log = res.log()
    assert f"validation loss at iteration 12 | lm loss value: {vals[12]:.6E} | lm loss PPL: " in log

    out = tmp_path / "report"
    assert report.main([str(run), "--out", str(out)]) == 0
    import json

    summary = json.loads((out / "summary.json").read_text())["runs"]["run"]
    assert [v["iteration"] for v in summary["validation"]] == [4, 8, 12]
    assert abs(summary["validation"][-1]["val_loss"] - vals[12]) < 1e-5
    assert "Validation loss" in (out / "report.html").read_text()
