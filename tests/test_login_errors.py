"""The login path as a new user meets it: every mistake or missing tool is one clear message and an
exit code (2 refused, 1 submission failed), never a traceback, and nothing is left behind."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PRETRAIN = REPO / "launch" / "pretrain.py"

FAKE_SBATCH = """#!/bin/sh
if [ -n "$FAKE_SBATCH_FAIL" ]; then
  echo "sbatch: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host" >&2
  echo "sbatch: error: Batch job submission failed: Invalid account or account/partition combination" >&2
  exit 1
fi
echo 555
"""


def _bin(tmp_path: Path, with_sbatch: bool) -> Path:
    """A PATH directory with python (and a fake sbatch when asked), and nothing else of Slurm's."""
    bin_dir = tmp_path / ("bin" if with_sbatch else "bin_nosbatch")
    bin_dir.mkdir(exist_ok=True)
    if with_sbatch:
        (bin_dir / "sbatch").write_text(FAKE_SBATCH)
        (bin_dir / "sbatch").chmod(0o755 | stat.S_IEXEC)
    return bin_dir


def cli(tmp_path: Path, *args: str, sbatch: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    path = f"{_bin(tmp_path, sbatch)}:{Path(sys.executable).parent}:/usr/bin/X11-none"
    proc = subprocess.run([sys.executable, str(PRETRAIN), *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PATH": path, **(env or {})})
    assert "Traceback" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr, proc.stderr[-2000:]
    return proc


def _runs(tmp_path: Path) -> list[str]:
    runs = tmp_path / "runs"
    return sorted(str(p.relative_to(runs)) for p in runs.rglob("*")) if runs.exists() else []


def test_no_sbatch_on_path_is_one_line_exit_1_and_leaves_nothing(tmp_path):
    proc = cli(tmp_path, "cluster=lustre", "model=30b", f"cluster.run_root={tmp_path / 'runs'}", "force=true",
               sbatch=False)
    assert proc.returncode == 1
    (line,) = [ln for ln in proc.stderr.splitlines() if not ln.startswith("note:")]
    assert "sbatch is not on PATH" in line and "cluster=local" in line
    assert _runs(tmp_path) == [] and not (tmp_path / "runs").exists()


def test_a_failed_submission_leaves_nothing_so_another_model_can_use_the_default_name(tmp_path):
    runs = f"cluster.run_root={tmp_path / 'runs'}"
    proc = cli(tmp_path, "cluster=lustre", "model=30b", runs, "force=true", env={"FAKE_SBATCH_FAIL": "1"})
    assert proc.returncode == 1 and "Invalid account" in proc.stderr and "res_nsearch" not in proc.stderr
    assert _runs(tmp_path) == []
    proc = cli(tmp_path, "cluster=lustre", "model=70b", runs, "force=true")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "runs" / "70b" / "config.yaml").exists()  # run.name defaults to the model's name
    proc = cli(tmp_path, "cluster=lustre", "model=30b", runs, "force=true")
    assert proc.returncode == 0 and (tmp_path / "runs" / "30b" / "sbatch.sh").exists()


def test_unwritable_run_root_is_refused_in_one_line(tmp_path):
    (tmp_path / "afile").write_text("not a directory")
    proc = cli(tmp_path, "cluster=lustre", "model=7b", f"cluster.run_root={tmp_path / 'afile' / 'runs'}",
               "force=true")
    assert proc.returncode == 2
    assert "cannot write the run directory" in proc.stderr and "cluster.run_root" in proc.stderr
    assert (tmp_path / "afile").read_text() == "not a directory"


@pytest.mark.parametrize("override, fragment", [
    ("+run.nmae=x", "did you mean run.name=...?"),
    ("+training.eval_intervall=5", "training.eval_intervall"),
    ("+bogus=1", "bogus: is not a field"),
])
def test_a_key_added_with_plus_that_the_schema_lacks_is_refused(tmp_path, override, fragment):
    proc = cli(tmp_path, override, "dry_run=true")
    assert proc.returncode == 2 and fragment in proc.stderr and proc.stdout == ""


def test_a_bad_interpolation_is_one_line(tmp_path):
    proc = cli(tmp_path, "run.name=${model.nmae}", "dry_run=true")
    assert proc.returncode == 2 and proc.stderr.startswith("refused: ") and len(proc.stderr.splitlines()) == 1


def test_mock_data_on_a_multi_node_gpu_job_needs_force(tmp_path):
    runs = f"cluster.run_root={tmp_path / 'runs'}"
    proc = cli(tmp_path, "cluster=lustre", "model=7b", runs)
    assert proc.returncode == 2 and "data.kind" in proc.stderr and "force=true" in proc.stderr
    assert _runs(tmp_path) == []
    dry = cli(tmp_path, "cluster=lustre", "model=7b", runs, "dry_run=true")
    assert dry.returncode == 0 and "note: data=mock" in dry.stderr  # a dry run says it, does not refuse


def test_a_missing_dataset_fails_the_dry_run(tmp_path):
    proc = cli(tmp_path, "data=indexed", f"data.path={tmp_path / 'nope' / 'corpus'}", "dry_run=true")
    assert proc.returncode == 2 and "data.path" in proc.stderr and proc.stdout == ""
