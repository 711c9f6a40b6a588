"""TensorBoard and W&B from a real Megatron-Core run that crashes and is restarted from its checkpoint:
read back with TensorBoard's own ``EventAccumulator``, one point per step, no duplicates; and the run's throughput
figures of that run, the same in the rank's line, status.py, TensorBoard, summary.json, report.md and the HTML."""
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


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    """One run that crashes at step 7 and is restarted from its step-4 checkpoint, trained once for this module's
    tests (TensorBoard and W&B across the restart; the run's figures in all six views)."""
    pytest.importorskip("tensorboard")  # without wandb installed the run trains on and says so (tracking_unavailable)
    run = tmp_path_factory.mktemp("restarted") / "run"
    env = {"WANDB_SILENT": "true", "WANDB_MODE": "offline"}
    first = train(run, BASE, world=1, attempt=0, timeout=300, extra_env={**env, "SLURMTRON_TEST_FAIL_AT_ITER": "7"})
    second = train(run, BASE, world=1, attempt=1, timeout=300, extra_env=env)
    return run, first, second


def test_tensorboard_and_wandb_continue_across_a_restart(restarted):
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, first, second = restarted
    assert first.codes != [0]  # crashed at step 7, after the checkpoint at step 4 and the log of steps 1..6
    assert sorted(first.losses) == list(range(1, 7))
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


def test_one_figure_per_quantity_in_all_six_views(restarted, tmp_path):
    """The run's step time, tokens/s, TFLOP/s, MFU and goodput (analysis/throughput.py: the median over every
    attempt's steady logged steps, the rates at it) read the same in the rank's end-of-attempt line, status.py,
    TensorBoard, summary.json, report.md and the HTML, on a run that crashed and was restarted."""
    import statistics

    from omegaconf import OmegaConf
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from analysis import throughput as tp
    from analysis.report import main as report_main
    from launch import status
    from launch.run_state import gather

    run, _first, second = restarted
    assert second.codes == [0], second.all_logs()
    # the definition, by hand: each attempt's first 2 logged steps are warm-up, the steps redone after the
    # restart count, the median of the rest
    attempts, times = [], []
    for e in second.events:
        if e["event"] == "job_start":
            attempts.append([])
        elif e["event"] == "iteration":
            attempts[-1].append(e["seconds"])
    assert [len(a) for a in attempts] == [6, 4]  # steps 1-6, then 5-8 from the step-4 checkpoint
    step_time = statistics.median(attempts[0][2:] + attempts[1][2:])

    out = tmp_path / "report"
    assert report_main([str(run), "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())["runs"]["run"]
    fig = tp.RunFigures(**s["throughput"])
    assert fig.steps == 6 and fig.source == "event log"
    assert fig.step_time_s == s["step_time_s"] == pytest.approx(step_time, rel=1e-12)
    cfg = OmegaConf.load(run / "config.yaml")
    tokens = cfg.training.global_batch_size * cfg.model.seq_length
    assert fig.tokens_per_s == s["tokens_per_s"] == pytest.approx(tokens / step_time, rel=1e-12)
    assert fig.tflops_per_gpu == s["tflops_per_gpu"] and fig.tflops_per_gpu > 0
    assert fig.mfu is None and s["mfu"] is None  # a CPU run: no peak, no MFU anywhere
    want = tp.line(fig)  # "step time 0.328 s, 1,562 tokens/s, 0.00265 TFLOP/s/GPU, MFU n/a"

    rank_log = (run / "logs" / "local_1_rank0.out").read_text(errors="replace")
    [rank_line] = [ln for ln in rank_log.splitlines() if ln.startswith("run throughput:")]
    assert f"run throughput: {want} (" in rank_line

    st = gather(run)
    text = status.format_state(st)
    assert f"throughput {want} (" in text
    assert st.throughput == s["throughput"] and st.tokens_per_s == s["tokens_per_s"]
    goodput = tp.pct_text(s["goodput"]["goodput"])
    assert f"goodput    {goodput}" in text

    md, html = (out / "report.md").read_text(), (out / "report.html").read_text()
    parts = (f"step time {tp.step_time_text(fig.step_time_s)}, {tp.tokens_text(fig.tokens_per_s)}, "
             f"{tp.tflops_text(fig.tflops_per_gpu)}, MFU n/a")
    for page in (md, html):
        assert f"throughput: {parts}" in page
        assert f"goodput {goodput}" in page

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tb = {tag: acc.Scalars(tag)[-1] for tag in ("run/step-time-s", "run/tokens-per-sec", "run/throughput")}
    assert {e.step for e in tb.values()} == {8}  # written as the last attempt ended
    assert tb["run/step-time-s"].value == pytest.approx(fig.step_time_s, rel=1e-6)  # float32 in the event file
    assert tb["run/tokens-per-sec"].value == pytest.approx(fig.tokens_per_s, rel=1e-6)
    assert tb["run/throughput"].value == pytest.approx(fig.tflops_per_gpu, rel=1e-6)
    assert "run/mfu" not in acc.Tags()["scalars"]
    texts = [bytes(t.tensor_proto.string_val[0]).decode() for t in acc.Tensors("events/text_summary")]
    assert any(f"run throughput: {want} (" in t for t in texts), texts
    # the per-step scalar is another figure, one point per step
    assert [e.step for e in acc.Scalars("iteration-time")] == list(range(1, ITERS + 1))
