"""Interruptions, goodput, MFU and the report CLI on a hand-made slurmtron run directory.

The run: job 100 (2 GPUs, H100 SXM, full recompute), requeued twice (sacct -D):
attempt 0 requeued after the time-limit warning (SIGUSR1) at step 12, resumed from 10;
attempt 1 lost its node at step 24 (NODE_FAIL, and NCCL timed out on the other rank),
resumed from 20; attempt 2 completed step 30. Every logged step took 10 s.
"""
from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

import pandas as pd
import pytest

from analysis.flops import hardware_flops, num_floating_point_operations, peak_flops
from analysis.interruptions import build_attempts, goodput, interruptions
from analysis.load import load_paths
from analysis.mfu import regression_flags, shape_from_config, step_metrics, straggler_flags
from analysis.report import main

REPO = Path(__file__).resolve().parents[1]
T0 = datetime(2026, 11, 29, 10, 0, 0)
MODEL = dict(name="tiny", num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4,
             num_query_groups=None, kv_channels=None, seq_length=128, vocab_size=256,
             make_vocab_size_divisible_by=128, swiglu=True, num_experts=None, moe_router_topk=2,
             moe_ffn_hidden_size=None)


def _line(step: int, when: datetime, ms: float = 10000.0) -> str:
    return (f"[{when:%Y-%m-%d %H:%M:%S.%f}] iteration {step:8d}/      30 | consumed samples: {step * 8:12d} | "
            f"elapsed time per iteration (ms): {ms:.1f} | throughput per GPU (TFLOP/s/GPU): 0.0 | "
            f"learning rate: 3.000000E-04 | global batch size:     8 | lm loss: {10 - step * 0.1:.6E} | "
            f"loss scale: 1.0 | grad norm: 1.000 | number of skipped iterations:   0 | "
            f"number of nan iterations:   0 |")


def _at(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)


def make_run(root: Path, name: str = "demo") -> Path:
    run = root / name
    (run / "logs").mkdir(parents=True)
    from omegaconf import OmegaConf

    OmegaConf.save(OmegaConf.create({
        "model": MODEL,
        "parallelism": {"name": "tp1", "tp": 1, "pp": 1, "cp": 1, "vpp": None, "recompute": "full"},
        "cluster": {"name": "t", "nodes": 1, "gpus_per_node": 2, "gpu": "h100_sxm"},
        "training": {"global_batch_size": 8, "precision": "bf16", "train_iters": 30},
    }), run / "config.yaml")
    log = ["NCCL INFO bootstrap"]
    log += [f"loading checkpoint from none"]  # not a checkpoint line
    log += [_line(s, _at(0.5) + timedelta(seconds=10 * s)) for s in range(1, 13)]
    log += ["saving checkpoint at iteration      10 to runs/demo/checkpoints/iter_0000010"]
    log += ["loading checkpoint from runs/demo/checkpoints/iter_0000010 at iteration 10",
            "  successfully loaded checkpoint from runs/demo/checkpoints/iter_0000010 at iteration 10 (0.5 s)"]
    log += [_line(s, _at(11.5) + timedelta(seconds=10 * (s - 10))) for s in range(11, 25)]
    log += ["loading checkpoint from runs/demo/checkpoints/iter_0000020 at iteration 20"]
    log += [_line(s, _at(30.5) + timedelta(seconds=10 * (s - 20))) for s in range(21, 31)]
    (run / "logs" / "100_1.out").write_text("\n".join(log) + "\n")
    (run / "logs" / "100_0.out").write_text(
        "[rank0]:[E1129 10:19:00.0 ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE) ran for 600000 milliseconds before timing out.\n")
    # the batch shell's output, as real Slurm writes it for a requeue (attempt 0) and node failure
    (run / "logs" / "100_batch.out").write_text(
        "slurmtron: job 100 restart 0 on n1\n"
        f"slurmstepd-n1: error: *** JOB 100 ON n1 CANCELLED AT {_at(10.1):%Y-%m-%dT%H:%M:%S} DUE TO JOB REQUEUE ***\n"
        "slurmtron: job 100 restart 1 on n1\n")
    ev = []

    def e(minutes, event, attempt, **kw):
        ev.append({"time": _at(minutes).timestamp(), "event": event, "job_id": "100", "restart_count": attempt,
                   "rank": 0, "host": "n1", **kw})

    e(0.2, "job_start", 0, world_size=2, layout={"tp": 1, "pp": 1}, train_iters=30)
    e(2.0, "checkpoint_saved", 0, step=10, path="x", seconds=2.0, bytes=1, reason="interval")
    e(9.0, "signal", 0, signal="SIGUSR2", step=12)
    e(9.1, "requeue", 0, method="scontrol", step=12)
    e(9.2, "exit", 0, reason="requeue", code=0, step=12)
    e(11.1, "job_start", 1, world_size=2, layout={"tp": 1, "pp": 1}, train_iters=30)
    e(11.2, "resume", 1, step=10, checkpoint="x", consumed_samples=80, from_layout=None)
    e(13.5, "checkpoint_saved", 1, step=20, path="x", seconds=2.0, bytes=1, reason="interval")
    e(30.1, "job_start", 2, world_size=2, layout={"tp": 1, "pp": 1}, train_iters=30)
    e(30.2, "resume", 2, step=20, checkpoint="x", consumed_samples=160, from_layout=None)
    e(32.5, "checkpoint_saved", 2, step=30, path="x", seconds=2.0, bytes=1, reason="final")
    e(32.6, "train_end", 2, step=30, consumed_samples=240)
    e(32.7, "exit", 2, reason="completed", code=0, step=30)
    (run / "events.jsonl").write_text("\n".join(json.dumps(x) for x in ev) + "\n{\"time\": 1.7e9, \"eve")
    f = "%Y-%m-%dT%H:%M:%S"
    (run / "sacct.txt").write_text("\n".join([
        "JobID|JobName|State|ExitCode|Submit|Start|End|Elapsed|NNodes|AllocTRES",
        f"100|demo|REQUEUED|0:0|{_at(0):{f}}|{_at(0.1):{f}}|{_at(10.1):{f}}|00:10:00|1|cpu=8,gres/gpu=2,node=1",
        f"100|demo|NODE_FAIL|1:0|{_at(10.5):{f}}|{_at(11):{f}}|{_at(20):{f}}|00:09:00|1|cpu=8,gres/gpu=2,node=1",
        f"100|demo|COMPLETED|0:0|{_at(25):{f}}|{_at(30):{f}}|{_at(33):{f}}|00:03:00|1|cpu=8,gres/gpu=2,node=1",
    ]) + "\n")
    return run


@pytest.fixture
def run_dir(tmp_path):
    return make_run(tmp_path)


def _analyze(run_dir):
    (run,) = load_paths([run_dir])
    att, it = build_attempts(run.iterations, run.signatures, run.checkpoints, run.events, run.sacct, gpus=2)
    return run, att, it


def test_attempts_and_interruptions_are_named_with_their_cause(run_dir):
    run, att, it = _analyze(run_dir)
    assert run.skipped["event_lines"] == 1  # the torn last line
    assert att["attempt"].tolist() == [0, 1, 2]
    assert att["first_step"].tolist() == [1, 11, 21] and att["last_step"].tolist() == [12, 24, 30]
    assert att["finished"].tolist() == [False, False, True]
    intr = interruptions(att)
    assert intr["cause"].tolist() == ["time_limit", "node_failure"]  # node failure outranks the NCCL timeout
    assert "nccl_timeout" in intr["evidence"].iloc[1]
    assert "slurm_cancel" in intr["evidence"].iloc[0]  # the batch log's JOB REQUEUE line, placed by its time
    assert set(att["job"]) == {"100"}
    assert intr["last_step"].tolist() == [12, 24]
    assert intr["resumed_from"].tolist() == [10, 20]
    assert intr["steps_lost"].tolist() == [2, 4]
    # 2 and 4 lost steps of 10 s on 2 GPUs
    assert intr["gpu_hours_lost"].tolist() == pytest.approx([2 * 10 * 2 / 3600, 4 * 10 * 2 / 3600])
    assert intr["queue_wait_s"].tolist() == pytest.approx([30.0, 300.0])
    # requeue (end of the attempt) to the first new step: 10:10:06 -> 10:11:40, 10:20 -> 10:30:40
    assert intr["restart_latency_s"].tolist() == pytest.approx([94.0, 640.0])


def test_goodput_breakdown_adds_up(run_dir):
    _, att, _ = _analyze(run_dir)
    gp = goodput(att)
    assert gp["allocated_s"] == 600 + 540 + 180
    assert gp["productive_s"] == 30 * 10.0  # every step 1..30 once
    assert gp["lost_work_s"] == (2 + 4) * 10.0  # steps redone after the restarts
    assert gp["checkpoint_s"] == 6.0
    parts = gp["productive_s"] + gp["lost_work_s"] + gp["checkpoint_s"] + gp["restart_overhead_s"]
    assert parts == pytest.approx(gp["allocated_s"])
    assert gp["goodput"] == pytest.approx(300 / 1320)
    assert gp["queue_wait_s"] == pytest.approx(6 + 30 + 300)
    assert gp["allocated_gpu_h"] == pytest.approx(1320 * 2 / 3600)


def test_mfu_and_hfu_use_the_audited_formula(run_dir):
    run, att, it = _analyze(run_dir)
    shape = shape_from_config(run.config)
    assert (shape.world_size, shape.device, shape.recompute, shape.layout) == (2, "h100_sxm", "full", "tp1-pp1-dp2")
    m = step_metrics(it, shape)
    flops = num_floating_point_operations(MODEL, 8)
    assert m["tflops"].iloc[0] == pytest.approx(flops / 10.0 / 2 / 1e12)
    assert m["mfu"].iloc[0] == pytest.approx(flops / 10.0 / 2 / peak_flops("h100_sxm", "bf16"))
    assert m["hfu"].iloc[0] == pytest.approx(hardware_flops(MODEL, 8, recompute="full") / 10.0 / 2 / 989e12)
    assert (m["hfu"] > m["mfu"]).all()
    assert m["tokens_per_s"].iloc[0] == pytest.approx(8 * 128 / 10.0)


def test_regression_and_straggler_flags():
    n = 60
    base = pd.DataFrame({"job": "1", "attempt": 0, "iteration": range(1, n + 1), "seq": range(n),
                         "timestamp": pd.date_range("2026-01-01", periods=n, freq="10s"),
                         "elapsed_ms": [1000.0] * 40 + [1300.0] * 20, "layout": "tp1", "rank": 0})
    f = regression_flags(base, window=10, baseline_steps=20, threshold=0.1)
    assert not f.loc[f["iteration"] < 40, "regressed"].any()
    assert f.loc[f["iteration"] >= 50, "regressed"].all()
    one_slow = base.copy()
    one_slow.loc[10, "elapsed_ms"] = 5000.0  # a single checkpoint step is not a regression
    assert not regression_flags(one_slow.head(40), window=10, baseline_steps=20)["regressed"].any()
    ranks = pd.concat([base.head(20).assign(rank=r, elapsed_ms=1000.0 * (1.3 if r == 3 else 1.0)) for r in range(4)])
    s = straggler_flags(ranks)
    assert s.loc[s["straggler"], "rank"].tolist() == [3]
    assert straggler_flags(base).empty  # one rank logs: nothing to compare


def test_report_cli_writes_every_output(run_dir, tmp_path):
    out = tmp_path / "out"
    assert main([str(run_dir), "--out", str(out)]) == 0
    for name in ("iterations.csv", "interruptions.csv", "summary.json", "report.md", "report.html",
                 "mfu_by_layout.png", "timeline_demo.png", "loss_by_step_demo.png", "goodput_demo.png"):
        assert (out / name).stat().st_size > 0, name
    its = pd.read_csv(out / "iterations.csv")
    assert len(its) == 12 + 14 + 10
    assert set(its["layout"]) == {"tp1-pp1"}  # from each attempt's job_start event
    assert {"source", "job_id", "timestamp", "iteration", "lm_loss", "elapsed_ms", "tflops_per_gpu",
            "skipped_iters", "nan_iters"} <= set(its.columns)
    intr = pd.read_csv(out / "interruptions.csv")
    assert intr["cause"].tolist() == ["time_limit", "node_failure"]
    s = json.loads((out / "summary.json").read_text())
    assert s["counts_by_cause"] == {"time_limit": 1, "node_failure": 1}
    assert s["goodput"] == pytest.approx(300 / 1320)
    assert 0 < s["mfu"] < s["hfu"] < 1
    assert s["skipped_lines"]["event_lines"] == 1
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 4 and "src=\"timeline" not in html


def test_report_runs_as_a_script_on_loose_files_and_a_sweep(run_dir, tmp_path):
    make_run(run_dir.parent, "second")
    out = tmp_path / "sweep"
    r = subprocess.run([sys.executable, str(REPO / "analysis" / "report.py"), str(run_dir.parent),
                        str(run_dir / "logs" / "100_1.out"), "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    s = json.loads((out / "summary.json").read_text())
    assert set(s["runs"]) == {"demo", "second", "files"}
    assert s["runs"]["second"]["counts_by_cause"] == {"time_limit": 1, "node_failure": 1}
    # the bare log alone: restarts seen in the file, no Slurm record to name a cause
    assert s["runs"]["files"]["attempts"] == 3
    # progress on stderr: one line as each phase begins (reading, each run, writing), with the seconds so far
    phases = [ln.split("] ", 1)[1].split(":")[0] for ln in r.stderr.splitlines() if ln.startswith("report: [")]
    assert phases == ["reading 2 input(s)"] + [f"analysing and plotting {n}" for n in ("demo", "second", "files")] + [
        f"writing iterations.csv, interruptions.csv, summary.json, report.md and report.html to {out}"], r.stderr


def test_unknown_gpu_leaves_mfu_empty_not_guessed(run_dir, tmp_path):
    out = tmp_path / "o"
    assert main([str(run_dir), "--out", str(out), "--gpu", "h100"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["mfu"] is None and s["runs"]["demo"]["tflops_per_gpu"] > 0


def test_hostile_and_missing_inputs(tmp_path):
    junk = tmp_path / "junk.out"
    junk.write_bytes(bytes(range(256)) * 100 + b"\n iteration 3/ 9 | elapsed time per iteration (ms): 5.0 |\n\x00")
    empty = tmp_path / "empty.out"
    empty.write_bytes(b"")
    sacct = tmp_path / "sacct.txt"
    sacct.write_text("JobID|State|Start|End\n7|TIMEOUT|bad|2026-01-01T00:00:00\n7|garbage\n")
    out = tmp_path / "o"
    assert main([str(junk), str(empty), str(sacct), "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["iterations"] == 1 and s["skipped_lines"]["sacct_lines"] == 1
    assert main([str(tmp_path / "nope"), "--out", str(out)]) == 2


def test_analysis_imports_neither_torch_nor_other_packages():
    # the exceptions (standard library only): launch.paths names the files of a run directory, launch.kinds and
    # launch.hardware_faults the words the ranks write in them, launch.attempts what an attempt is
    code = ("import sys, analysis.report, analysis.flops; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'launch', 'recovery') "
            "and m not in ('launch', 'launch.paths', 'launch.kinds', 'launch.hardware_faults', 'launch.attempts')]; "
            "sys.exit(repr(bad) if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr


SLURM_RUN = REPO / "tests" / "fixtures" / "slurm_run"


@pytest.mark.skipif(not (SLURM_RUN / "events.jsonl").is_file(),
                    reason="tests/fixtures/slurm_run/ (made by real Slurm with make_fixture.py) is not there yet")
def test_report_names_the_real_slurm_interruptions(tmp_path):
    # make_fixture.py: preempted at step 4 (an urgent job takes a node), then a node crash after the
    # step-10 checkpoint of the second attempt (NODE_FAIL), then completed.
    out = tmp_path / "o"
    assert main([str(SLURM_RUN), "--out", str(out)]) == 0
    intr = pd.read_csv(out / "interruptions.csv")
    assert intr["cause"].tolist() == ["preemption", "node_failure"]
    assert intr["resumed_from"].tolist() == [6, 10]  # the SIGTERM checkpoint, the step-10 interval one
    assert intr["last_step"].iloc[1] > 10 and intr["steps_lost"].iloc[1] == intr["last_step"].iloc[1] - 10
    # the batch log's "Node failure" line is placed in attempt 1 by the banner before it
    assert "node_failure" in intr["evidence"].iloc[1].replace("sacct NODE_FAIL", "")
    s = json.loads((out / "summary.json").read_text())
    assert s["counts_by_cause"] == {"preemption": 1, "node_failure": 1}
    assert 0 < s["goodput"] < 1


def test_nan_loss_at_the_end_of_an_attempt_is_the_cause():
    from analysis.parse_megatron import parse_iteration_text

    lines = [_line(s, _at(s / 6)) for s in range(1, 6)]
    lines[-1] = lines[-1].replace("lm loss: 9.500000E+00", "lm loss: nan")
    lines[1] = lines[1].replace(" lm loss: 9.800000E+00 |", "")  # a step without a loss is not a NaN
    lines += [_line(s, _at(30 + s / 6)) for s in range(5, 9)]  # restarted from step 4
    text = "\n".join(lines[:5]) + "\nslurmtron: restart\n" + "\n".join(lines[5:])
    it, _ = parse_iteration_text(text, source="logs/100_0.out", job_id="100", offsets=True)
    assert it["lm_loss"].isna().sum() == 2 and it["nonfinite"].sum() == 1
    att, _ = build_attempts(it)
    assert att["attempt"].tolist() == [0, 1]
    assert interruptions(att)["cause"].tolist() == ["nan"]
    it.loc[it["lm_loss"].isna(), "nonfinite"] = False
    assert interruptions(build_attempts(it)[0])["cause"].tolist() == ["unknown"]


@pytest.mark.parametrize("reason,signal", [
    ("user_cancel", "SIGTERM"), ("user_stop", None), ("user_requeue", "SIGUSR2"), ("preemption", "SIGTERM"),
    ("time_limit", "SIGUSR2"), ("node_failure", "SIGTERM"),
])
def test_the_ranks_stop_decision_names_the_cause(reason, signal):
    """A stop event decided from Slurm's answer (recovery/stop.py) beats the guesses: a USR2 is not
    always the time limit, and a bare slurmstepd cancel line is not always a user cancel."""
    from analysis.parse_events import parse_events_text
    from analysis.parse_megatron import parse_iteration_text
    from analysis.signatures import parse_signature_text

    text = "\n".join(_line(s, _at(s / 6)) for s in range(1, 6))
    text += f"\nslurmstepd: error: *** STEP 100.0 ON stn1 CANCELLED AT {_at(1):%Y-%m-%dT%H:%M:%S} ***\n"
    it, _ = parse_iteration_text(text, source="logs/100_0.out", job_id="100", offsets=True)
    sigs, _ = parse_signature_text(text, source="logs/100_0.out", job_id="100")
    base = _at(0).timestamp()
    recs = [{"time": base + 1, "event": "job_start", "job_id": "100", "restart_count": 0}]
    if signal:
        recs.append({"time": base + 50, "event": "signal", "job_id": "100", "restart_count": 0, "signal": signal,
                     "step": 5})
    recs.append({"time": base + 52, "event": "stop", "job_id": "100", "restart_count": 0, "reason": reason,
                 "requeue": reason not in ("user_cancel", "user_stop"), "evidence": "sacct CANCELLED by 0", "step": 5})
    recs.append({"time": base + 53, "event": "exit", "job_id": "100", "restart_count": 0, "reason": "stopped",
                 "step": 5})
    ev, _ = parse_events_text("\n".join(json.dumps(r) for r in recs))
    att, _ = build_attempts(it, sigs, None, ev, gpus=2, train_iters=30)
    intr = interruptions(att)
    assert intr["cause"].tolist() == [reason]
    assert f"event stop {reason}: sacct CANCELLED by 0" in intr["evidence"].iloc[0]


def test_a_crash_is_a_crash_unless_a_signature_says_more():
    from analysis.parse_events import parse_events_text
    from analysis.parse_megatron import parse_iteration_text
    from analysis.signatures import parse_signature_text

    text = "\n".join(_line(s, _at(s / 6)) for s in range(1, 4))
    it, _ = parse_iteration_text(text, source="logs/7_0.out", job_id="7", offsets=True)
    base = _at(0).timestamp()
    ev, _ = parse_events_text("\n".join(json.dumps(r) for r in [
        {"time": base + 1, "event": "job_start", "job_id": "7", "restart_count": 0},
        {"time": base + 40, "event": "stop", "job_id": "7", "restart_count": 0, "reason": "crash", "detail": "x"},
        {"time": base + 41, "event": "exit", "job_id": "7", "restart_count": 0, "reason": "error"}]))
    assert interruptions(build_attempts(it, None, None, ev, train_iters=30)[0])["cause"].tolist() == ["crash"]
    oom = text + "\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    sigs, _ = parse_signature_text(oom, source="logs/7_0.out", job_id="7")
    it, _ = parse_iteration_text(oom, source="logs/7_0.out", job_id="7", offsets=True)
    assert interruptions(build_attempts(it, sigs, None, ev, train_iters=30)[0])["cause"].tolist() == ["oom"]
