"""The GPU device check (benchmarks/gpu/run.sh) in its --cpu mode: every step but CUDA, so the kit
cannot rot while no GPU machine is lent. One real run of the real worker, resume and preflight."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.training
def test_gpu_kit_cpu_mode(tmp_path: Path) -> None:
    out = tmp_path / "results"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "KIT_TIMEOUT_S": "420", "KIT_BUDGET_S": "400"}
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu" / "run.sh"), "--cpu"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=480)
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(out.glob("*.log")))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:] + logs
    r = json.loads((out / "results.json").read_text())
    assert r["ok"] is True and r["mode"] == "cpu" and r["version_check"] == "ok"
    assert r["versions"]["torch"] and r["versions"]["megatron_core"] and r["versions"]["cuda_available"] is False
    assert r["train"]["exit_code"] == 0 and r["train"]["steps_measured"] >= 1
    assert r["train"]["tflops_per_gpu_median"] is None  # cluster.gpu=cpu: the log carries no TFLOP/s field
    assert r["train"]["mfu_median"] is None  # cluster.gpu=cpu has no peak in the table: no MFU, never a guess
    save = r["save"]
    assert save["bytes"] > 0 and save["disk_fsynced_write_gb_per_s"] > 0
    assert save["sync"]["step"] == 4 and save["sync"]["seconds"] > 0 and save["sync"]["gb_per_s"] > 0
    assert save["async"]["step"] == 3 and save["async"]["mode"] == "async"  # the resumed checkpoint is the async one
    assert 0 < save["async"]["blocking_s"] <= save["async"]["written_s"] <= save["async"]["durable_s"]
    assert save["blocking_fraction_of_sync"] > 0 and save["step_s_with_write_in_flight"] > 0
    res = r["resume"]
    assert res["from_step"] == 3 and res["bitwise_equal"] is True
    assert all(v["uninterrupted"] == v["resumed"] is not None for v in res["losses"].values())
    assert r["preflight"]["exit_code"] == 0
    mem = r["memory"]  # the CPU has an RSS and no allocator peak: the ratio to the planner is left empty, not guessed
    assert mem["planner_gib"] > 0 and "weights" in mem["planner_breakdown"] and mem["rss_gib"] > 0
    assert mem["measured_peak_allocated_gib"] is None and mem["planner_over_measured"] is None
    oom = r["oom"]
    assert oom["exit_code"] == 18 and oom["reason"] == "oom" and "planner estimate" in oom["detail"]
    assert oom["files"] == ["local_0_rank0.memory_summary.txt"]  # no snapshot without CUDA
    assert r["preflight"]["checks"]["grad_flow"] == "PASS"
    assert r["preflight"]["checks"]["checkpoint_roundtrip"] == "PASS"
    local = r["local"]  # the same job without and with local saves every 5 steps; the overhead is only reported
    assert local["exit_codes"] == [0, 0] and local["local_tier"]["saves_at"] == [5, 10]
    assert local["local_tier"]["shard_bytes"] > 0 and all(x > 0 for x in local["local_tier"]["stall_s"])
    assert local["local_base"]["window_s"] > 0 and "overhead_every_5" in local
    files = {p.name for p in out.iterdir()}
    assert {"results.json", "run.log", "train.log", "resume.log", "preflight.log", "nvidia-smi.txt", "local.log"} <= files
    assert len(files) <= 8  # what comes back from the device machine
