"""Parsers on real Megatron logs (../shared/real_logs), hand-made fixtures and hostile input."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analysis.parse_events import parse_events_text
from analysis.parse_megatron import (
    iter_text_chunks, parse_checkpoint_text, parse_iteration_lines, parse_iteration_text,
    parse_iterations_file, source_ids,
)
from analysis.parse_slurm import parse_sacct_text
from analysis.signatures import parse_signature_text

REAL = Path(__file__).resolve().parents[1].parent / "shared" / "real_logs" / "bigscience_jeanzay_2021"
FIX = Path(__file__).resolve().parent / "fixtures" / "analysis"
needs_real = pytest.mark.skipif(not REAL.is_dir(), reason=f"real logs not found at {REAL} (../shared/real_logs beside the repo)")

CURRENT = ("[2026-11-29 10:00:00.123456] iteration        5/      20 | consumed samples:           40 | "
           "elapsed time per iteration (ms): 812.3 | throughput per GPU (TFLOP/s/GPU): 0.1 | "
           "learning rate: 3.000000E-04 | global batch size:     8 | lm loss: 5.512345E+00 | loss scale: 1.0 | "
           "grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 |")


def _lines(p: Path) -> list[str]:
    return p.read_bytes().decode("utf-8", errors="replace").splitlines()


# ---------------------------------------------------------------- real logs -------------
@needs_real
@pytest.mark.parametrize("path", sorted(REAL.glob("*.out")) if REAL.is_dir() else [], ids=lambda p: p.name)
def test_every_real_iteration_line_is_parsed(path):
    lines = _lines(path)
    # independent counts: plain substring tests, no regex shared with the parser
    n_iter = sum(1 for ln in lines if " iteration " in ln and "elapsed time per iteration" in ln)
    n_loss = sum(1 for ln in lines if " iteration " in ln and ("lm loss:" in ln or "lm-loss:" in ln))
    df, skipped = parse_iterations_file(path)
    assert len(df) == n_iter
    assert df["lm_loss"].notna().sum() == n_loss
    assert skipped == 0
    assert not df["nonfinite"].any()  # fp16 skipped steps print no loss: that is not a NaN
    # file order is kept and iterations increase within these single-attempt logs
    assert df["iteration"].is_monotonic_increasing
    # the numbers are the ones printed on the line
    first = next(ln for ln in lines if " iteration " in ln and "elapsed time per iteration" in ln)
    ms = float(first.split("elapsed time per iteration (ms):")[1].split("|")[0])
    assert df["elapsed_ms"].iloc[0] == ms


@needs_real
def test_real_skipped_iteration_counts_are_read():
    df, _ = parse_iterations_file(REAL / "meg_gpt2_base_n8_dp1_tp4_pp8-1809562.out")
    # fp16 loss-scale warm-up: the first logged interval skipped all 10 of its iterations
    lines = [ln for ln in _lines(REAL / "meg_gpt2_base_n8_dp1_tp4_pp8-1809562.out")
             if " iteration " in ln and "number of skipped iterations" in ln]
    printed = [int(ln.split("number of skipped iterations:")[1].split("|")[0]) for ln in lines]
    assert df["skipped_iters"].astype(int).tolist() == printed
    assert df["skipped_iters"].iloc[0] == 10
    assert df["skipped_iters"].sum() > 0


@needs_real
def test_real_time_limit_and_user_cancels_are_categorized():
    found = {}
    for p in sorted(REAL.glob("*.out")):
        sig, _ = parse_signature_text(p.read_bytes().decode("utf-8", "replace"), source=str(p))
        jobs = sig[sig["kind"] == "slurm_cancel"]
        for r in jobs.itertuples():
            found[r.slurm_job] = r.cause
    assert found["1999616"] == "time_limit"
    assert found["1999618"] == "time_limit"
    assert found["1809655"] == "time_limit"
    for job in ("1809562", "1809577", "1809579", "1809620"):
        assert found[job] == "user_cancel"
    assert len(found) == 7


def test_source_ids_from_file_names():
    assert source_ids("logs/1234_7.out") == ("1234", 7)
    assert source_ids("logs/1234_batch.out") == ("1234", None)
    assert source_ids("logs/1234_5_0.out") == ("1234_5", 0)
    assert source_ids("logs/local_2_rank1.out") == ("local-2", 1)
    assert source_ids("meg_gpt2_base_n8_dp1_tp4_pp8-1809562.out") == ("1809562", None)
    assert source_ids("meg_gpt2_perf_n16.out") == (None, None)


# ---------------------------------------------------------------- formats ---------------
def test_current_format_with_mfu_field():
    line = CURRENT.replace("| learning rate", "| MFU: 41.23% | learning rate")
    df, skipped = parse_iteration_text(line)
    r = df.iloc[0]
    assert (r.iteration, r.train_iters, r.consumed_samples, r.elapsed_ms) == (5, 20, 40, 812.3)
    assert (r.tflops_per_gpu, r.mfu_pct, r.lr, r.lm_loss, r.grad_norm) == (0.1, 41.23, 3e-4, 5.512345, 1.234)
    assert r.timestamp == pd.Timestamp("2026-11-29 10:00:00.123456")
    assert skipped == 0


def test_hand_made_hostile_mix():
    df, skipped = parse_iterations_file(FIX / "hostile_mix.out")
    assert df["iteration"].tolist() == [1, 2, 3]
    assert pd.isna(df["timestamp"].iloc[0]) and df["timestamp"].iloc[2] == pd.Timestamp("2026-11-29 10:00:03")
    assert df["tflops_per_gpu"].iloc[1] == 1.5 and df["mfu_pct"].iloc[1] == 0.15
    assert math.isnan(df["lm_loss"].iloc[2]) and df["grad_norm"].iloc[2] == math.inf  # nan/inf are data
    assert df["nan_iters"].iloc[2] == 1
    assert df["nonfinite"].tolist() == [False, False, True]  # printed nan/inf, not an absent field
    assert skipped == 2  # the cut-off line and the absurd iteration number


def test_lines_api_and_interleaved_ranks():
    a = CURRENT
    b = CURRENT.replace("iteration        5/", "iteration        6/")
    junk = "NCCL INFO Channel 00 : 0[0] -> 1[1] via P2P/IPC"
    df, skipped = parse_iteration_lines(pd.Series([junk, "1: " + a, "0: " + b, a[:60] + b, junk]))
    # the glued line (rank 1's line cut by rank 0's) still yields its complete part
    assert sorted(df["iteration"].tolist()) == [5, 6, 6]
    assert skipped == 1


def test_checkpoint_lines():
    text = "\n".join([
        "saving checkpoint at iteration      10 to runs/x/checkpoints/iter_0000010",
        "  successfully saved checkpoint at iteration      10 to runs/x/checkpoints",
        "saving checkpoint at iteration      20 to /ck/iter_20",
        "loading checkpoint from /ck/iter_10 at iteration 10",
        "  successfully loaded checkpoint from /ck/iter_10 [ t 1/1, p 1/1 ] at iteration 10",
        "  successfully saved checkpoint from iteration      30 to /ck [ t 1/4, p 1/1 ]",
    ])
    df, skipped = parse_checkpoint_text(text)
    assert df["kind"].tolist() == ["save", "saved", "save", "load", "loaded", "saved"]
    assert df["iteration"].tolist() == [10, 10, 20, 10, 10, 30]
    assert df["path"].iloc[3] == "/ck/iter_10"
    assert skipped == 0


def test_error_signatures_and_causes():
    text = "\n".join([
        "slurmstepd: error: *** JOB 77 ON n1 CANCELLED AT 2026-11-29T10:00:00 DUE TO PREEMPTION ***",
        "slurmstepd: error: *** JOB 78 ON n2 CANCELLED AT 2026-11-29T10:00:00 DUE TO NODE FAILURE ***",
        "slurmstepd: error: *** JOB 79 ON n3 CANCELLED AT 2026-11-29T10:00:00 ***",
        "[rank3]:[E1129 10:00:00.0 ProcessGroupNCCL.cpp:616] [Rank 3] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE) ran for 600000 milliseconds before timing out.",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "NVRM: Xid (PCI:0000:3b:00): 79, pid=123, GPU has fallen off the bus.",
        "found NaN in local grad norm in backward pass",
        "Main process received SIGTERM, exiting",
        "slurmstepd-stn1: error: *** JOB 80 ON stn1 CANCELLED AT 2026-11-29T10:44:54 DUE TO NODE FAILURE, SEE "
        "SLURMCTLD LOG FOR DETAILS ***",
        "slurmstepd-stn1: error: *** STEP 80.0 ON stn1 CANCELLED AT 2026-11-29T10:43:11 ***",
        "slurmstepd-stn1: error: *** JOB 80 ON stn1 CANCELLED AT 2026-11-29T10:43:17 DUE TO JOB REQUEUE ***",
        "slurmtron: job 80 restart 2 on stn[3-4] run /scratch/runs/x",
    ])
    df, _ = parse_signature_text(text)
    assert [c if isinstance(c, str) else None for c in df["cause"]] == [
        "preemption", "node_failure", "user_cancel", "nccl_timeout", "oom", "xid", "nan", None,
        "node_failure", None, "unknown", None]  # a step cancelled without a reason is what a requeue does
    assert df["kind"].iloc[-1] == "attempt_start" and df["detail"].iloc[-1] == "2"
    assert df["at"].iloc[0] == pd.Timestamp("2026-11-29 10:00:00")
    assert df["slurm_job"].iloc[1] == "78" and df["host"].iloc[1] == "n2"


SACCT = """JobID|JobName|State|ExitCode|Submit|Start|End|Elapsed|NNodes|AllocTRES
100|tron|REQUEUED|0:0|2026-11-29T10:00:00|2026-11-29T10:00:10|2026-11-29T10:10:10|00:10:00|1|cpu=8,gres/gpu=2,node=1
100.batch|batch|CANCELLED|0:15|2026-11-29T10:00:10|2026-11-29T10:00:10|2026-11-29T10:10:10|00:10:00|1|cpu=8,gres/gpu=2
100|tron|NODE_FAIL|1:0|2026-11-29T10:10:20|2026-11-29T10:11:00|2026-11-29T10:20:00|00:09:00|1|cpu=8,gres/gpu=2,node=1
100.batch|batch|CANCELLED|0:15|2026-11-29T10:11:00|2026-11-29T10:11:00|2026-11-29T10:20:00|00:09:00|1|cpu=8
this line is shell noise
100|tron|COMPLETED|0:0|2026-11-29T10:25:00|2026-11-29T10:30:00|2026-11-29T10:33:00|1-00:03:00|1|gres/gpu=2
101|tron|CANCELLED by 1000|0:0|2026-11-29T11:00:00|None|Unknown|00:00:00|1|
101|tro"""


def test_sacct_duplicates_are_attempts():
    df, skipped = parse_sacct_text(SACCT)
    assert skipped == 2  # noise and the truncated last line
    alloc = df[df["is_alloc"]]
    assert alloc[alloc["job"] == "100"]["attempt"].tolist() == [0, 1, 2]
    assert alloc["state"].tolist() == ["REQUEUED", "NODE_FAIL", "COMPLETED", "CANCELLED"]
    assert df.loc[df["job"] == "101", "cancelled_by"].iloc[0] == "1000"
    assert df[~df["is_alloc"]]["attempt"].tolist() == [0, 1]
    assert alloc["elapsed_s"].tolist() == [600, 540, 86580, 0]
    assert alloc["gpus"].iloc[0] == 2
    assert pd.isna(alloc["start"].iloc[3])


def test_sacct_header_order_is_read_not_assumed():
    df, skipped = parse_sacct_text("State|Start|JobID\nTIMEOUT|2026-01-01T00:00:00|5\n5.0|x\n")
    assert df["state"].tolist() == ["TIMEOUT"] and df["job"].tolist() == ["5"]
    assert df["start"].iloc[0] == pd.Timestamp("2026-01-01")
    assert skipped == 1


def test_events_torn_and_bad_lines_are_skipped():
    good = {"time": 1.7e9, "event": "resume", "job_id": "100", "restart_count": 1, "rank": 0, "host": "n1", "step": 10}
    text = "\n".join([json.dumps(good), '{"time": 1.7e9, "event": "exit", "job', "[1, 2]", "not json",
                      json.dumps({"event": "x"}), json.dumps({**good, "event": "exit", "reason": "requeue"})])
    df, skipped = parse_events_text(text)
    assert df["event"].tolist() == ["resume", "exit"]
    assert df["step"].tolist() == [10, 10]
    assert skipped == 4


# ---------------------------------------------------------------- hostile input ---------
def test_empty_and_binary_files(tmp_path):
    empty = tmp_path / "empty.out"
    empty.write_bytes(b"")
    df, skipped = parse_iterations_file(empty)
    assert df.empty and skipped == 0
    junk = tmp_path / "junk.out"
    rng = np.random.default_rng(0)
    junk.write_bytes(rng.integers(0, 256, 200_000, dtype=np.uint8).tobytes() + b"\n" + CURRENT.encode() + b"\n\xff\xfe")
    df, skipped = parse_iterations_file(junk, chunk_bytes=4096)
    assert df["iteration"].tolist() == [5]


def test_chunk_boundaries_do_not_lose_or_split_lines(tmp_path):
    p = tmp_path / "many.out"
    lines = [CURRENT.replace("iteration        5/", f"iteration {i:8d}/") for i in range(1, 301)]
    p.write_bytes(("\n".join(lines) + "\n").encode())
    for chunk in (97, 1000, 4096, 1 << 20):
        df, skipped = parse_iterations_file(p, chunk_bytes=chunk)
        assert df["iteration"].tolist() == list(range(1, 301)), chunk
        assert skipped == 0
    text = "".join(t for _, t in iter_text_chunks(p, 97))
    assert text == p.read_text()
    df, skipped = parse_iterations_file(p, chunk_bytes=4096, workers=3)  # line-aligned byte ranges
    assert df["iteration"].tolist() == list(range(1, 301)) and skipped == 0


def test_huge_numbers_do_not_crash():
    line = CURRENT.replace("812.3", "1" + "0" * 400).replace("5.512345E+00", "9" * 500)
    df, skipped = parse_iteration_text(line)
    assert len(df) == 1 and df["elapsed_ms"].iloc[0] == math.inf


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2000), st.integers(0, len(CURRENT)))
def test_fuzz_parsers_never_raise(blob, cut):
    text = (blob + b"\n" + CURRENT[:cut].encode() + b"\n" + blob[::-1]).decode("utf-8", errors="replace")
    df, skipped = parse_iteration_text(text)
    assert skipped >= 0 and len(df) <= text.count("iteration")
    parse_checkpoint_text(text)
    parse_signature_text(text)
    parse_sacct_text(text)
    parse_events_text(text)
    parse_sacct_text("JobID|State\n" + text)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["iteration", " | ", "lm loss:", "elapsed time per iteration (ms):", "1",
                                 "nan", "/", "[2026-11-29 10:00:00.1]", "\n", "  ", "E+", "|", "-"]), max_size=60))
def test_fuzz_near_miss_lines(parts):
    text = "".join(parts)
    df, skipped = parse_iteration_text(text)
    assert (df["elapsed_ms"].notna() | df["lm_loss"].notna()).all()
    assert skipped >= 0


@needs_real
def test_real_logs_interruptions_by_cause():
    from analysis.interruptions import build_attempts, interruptions
    from analysis.load import load_paths

    (run,) = load_paths(sorted(REAL.glob("*.out")))
    att, _ = build_attempts(run.iterations, run.signatures, run.checkpoints)
    intr = interruptions(att).set_index("job")
    assert intr["cause"].to_dict() == {
        "1809562": "user_cancel", "1809577": "user_cancel", "1809579": "user_cancel", "1809620": "user_cancel",
        "1809655": "time_limit", "1999616": "time_limit", "1999618": "time_limit",
    }
    assert intr.loc["1809655", "last_step"] == 60  # the last iteration line before the time limit
    assert intr.loc["1999616", "time"] == pd.Timestamp("2021-05-27 21:42:11")
