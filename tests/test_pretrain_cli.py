"""The login-node entry point as a user runs it: ``python launch/pretrain.py k=v ...``."""
from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from launch import pretrain
from launch.check import check
from launch.compose import CONFIG_DIR, to_job
from launch.config import register_configs

REPO = Path(__file__).resolve().parent.parent
PRETRAIN = REPO / "launch" / "pretrain.py"
MODELS = sorted(p.stem for p in (CONFIG_DIR / "model").glob("*.yaml"))
CLUSTERS = sorted(p.stem for p in (CONFIG_DIR / "cluster").glob("*.yaml"))


def run_cli(args, cwd, env=None, timeout=120):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def imported_modules(importtime_stderr: str) -> set[str]:
    mods = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            mods.add(line.rsplit("|", 1)[1].strip())
    return mods


def test_dry_run_prints_a_valid_script_imports_no_torch_and_writes_nothing(tmp_path):
    proc = run_cli(["-X", "importtime", str(PRETRAIN), "cluster=lustre", "model=30b", "dry_run=true"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    mods = imported_modules(proc.stderr)
    assert "omegaconf" in mods and "launch.check" in mods  # the parse sees the real imports
    heavy = sorted(m for m in mods if m.split(".")[0] in ("torch", "megatron", "transformer_engine"))
    assert heavy == [], f"the login path imported {heavy}"
    assert subprocess.run(["bash", "-n"], input=proc.stdout, text=True, timeout=30).returncode == 0
    for line in ("#SBATCH --requeue", "#SBATCH --signal=USR2@300", "#SBATCH --open-mode=append",
                 "#SBATCH --nodes=16", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --time=60", "#SBATCH --partition=gpu", "#SBATCH --job-name=30b", "lfs setstripe"):
        assert line in proc.stdout
    assert "#   num_layers: 60" in proc.stdout  # the composed config, as comments
    assert list(tmp_path.iterdir()) == []  # no outputs/, no run directory


def test_refused_job_exits_2_with_every_reason(tmp_path):
    proc = run_cli([str(PRETRAIN), "cluster=lustre", "model=30b", "parallelism.tp=8", "run.time_limit_min=9999",
                    "dry_run=true"], cwd=tmp_path)
    assert proc.returncode == 2
    assert "model.num_attention_heads" in proc.stderr and "run.time_limit_min" in proc.stderr
    assert proc.stdout == "" and list(tmp_path.iterdir()) == []


FAKE_SBATCH = """#!/bin/sh
echo "$@" >> "$FAKE_SBATCH_LOG"
echo 777
"""


def test_multirun_skips_invalid_members_submits_valid_ones_and_keeps_a_registry(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(FAKE_SBATCH)
    (bin_dir / "sbatch").chmod(0o755 | stat.S_IEXEC)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_SBATCH_LOG": str(tmp_path / "calls")}
    runs = tmp_path / "runs"
    proc = run_cli([str(PRETRAIN), "-m", "cluster=lustre", "model=7b", f"cluster.run_root={runs}", "force=true",
                    "parallelism.tp=2,3,4"], cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (registry,) = list((runs / "sweeps").glob("*.jsonl"))
    assert (runs / "sweeps" / registry.stem / "multirun.yaml").exists()  # Hydra's record, beside the registry
    rows = [json.loads(line) for line in registry.read_text().splitlines()]
    assert [(r["job_num"], r["status"]) for r in rows] == [(0, "submitted"), (1, "refused"), (2, "submitted")]
    assert [r["run_name"] for r in rows] == ["7b_tp2", "7b_tp3", "7b_tp4"]  # named by the swept values
    assert rows[0]["layout"].startswith("tp2-pp1") and rows[0]["mesh"]["tp"] == 2 and rows[0]["mesh"]["dp"] == 64
    assert rows[0]["job_id"] == "777" and rows[0]["overrides"][-1] == "parallelism.tp=2"
    assert any("model.num_attention_heads" in reason for reason in rows[1]["reasons"])
    assert (runs / "7b_tp2" / "sbatch.sh").exists() and not (runs / "7b_tp3").exists()
    assert "sweep member 7b_tp3 (tp3-pp1" in proc.stderr  # the refusal says which member
    table = proc.stderr[proc.stderr.index(f"sweep {registry.stem}: 3 member(s)"):]
    assert "7b_tp2" in table and "submitted  777" in table and "refused" in table and "MFU" in table
    assert f"registry: {registry}" in table and f"status.py cluster.run_root={runs} {registry.stem}" in table
    assert len((tmp_path / "calls").read_text().splitlines()) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "calls", "runs"]  # no multirun/ folder


def test_a_dry_run_sweep_writes_nothing_and_ends_with_a_table(tmp_path):
    runs = tmp_path / "runs"
    proc = run_cli([str(PRETRAIN), "-m", "cluster=lustre", "model=7b", f"cluster.run_root={runs}", "dry_run=true",
                    "parallelism.tp=2,3"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []  # no registry, no multirun.yaml, no run directory
    assert "7b_tp2" in proc.stderr and "ok (dry run)" in proc.stderr and "refused" in proc.stderr
    assert "registry:" not in proc.stderr


def _cfg(overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_dry_run_of_every_valid_model_cluster_pair(cluster, tmp_path):
    valid = 0
    max_time = to_job(_cfg([f"cluster={cluster}"])).cluster.max_time_min
    for model in MODELS:
        cfg = _cfg([f"cluster={cluster}", f"model={model}", "dry_run=true", f"run.dir={tmp_path / model}",
                    f"run.time_limit_min={min(60, max_time)}"])  # a slice the partition allows
        if check(to_job(cfg)):
            continue
        valid += 1
        out = io.StringIO()
        assert pretrain.main(cfg, out=out, err=io.StringIO()) == 0
        assert subprocess.run(["bash", "-n"], input=out.getvalue(), text=True, timeout=30).returncode == 0
        assert ("#SBATCH --requeue" in out.getvalue() or "#SBATCH --no-requeue" in out.getvalue()) == (
            to_job(cfg).cluster.launcher == "slurm")
        assert not (tmp_path / model).exists()
    assert valid >= 1, f"no shipped model is valid on cluster={cluster}"


def test_member_names():
    job = to_job(_cfg(["cluster=lustre", "model=7b", "run.name=exp"]))
    task = ["run.name=exp", "parallelism.tp=4", "parallelism.pp=2", "cluster=lustre"]
    label = pretrain.member_label(task, pretrain.swept_keys(["-m", "parallelism.tp=2,4", "parallelism.pp=1,2"]))
    assert label == "tp4-pp2"
    shared = pretrain.SweepMember("s", 3, task, label=label)
    assert pretrain.member_job(job, shared).run.name == "exp_tp4-pp2"  # a shared name is a prefix
    own = pretrain.SweepMember("s", 3, ["run.name=exp"], name_swept=True)
    assert pretrain.member_job(job, own).run.name == "exp"
    assert pretrain.run_name_swept(["-m", "run.name=a,b", "parallelism.tp=1,2"])
    assert not pretrain.run_name_swept(["-m", "run.name=a", "parallelism.tp=1,2"])
