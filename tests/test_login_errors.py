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


def test_mock_data_on_a_multi_node_gpu_job_is_a_warning_not_a_refusal(tmp_path):
    """The headline command (Megatron's own examples benchmark a cluster on synthetic tokens): the dry run's `next`
    line is true (the same command submits), and both say WARNING loudly."""
    runs = f"cluster.run_root={tmp_path / 'runs'}"
    dry = cli(tmp_path, "cluster=lustre", "model=30b", runs, "dry_run=true")
    assert dry.returncode == 0 and "WARNING: data=mock: 16 nodes x 8" in dry.stderr, dry.stderr
    assert "the same command without dry_run=true submits it" in dry.stderr
    assert _runs(tmp_path) == []
    real = cli(tmp_path, "cluster=lustre", "model=30b", runs)
    assert real.returncode == 0 and "submitted job 555" in real.stdout, real.stderr
    assert "WARNING: data=mock: 16 nodes x 8" in real.stderr
    assert "WARNING: 16 nodes on synthetic tokens" in real.stdout  # the submission's summary, data row


def test_a_missing_dataset_fails_the_dry_run(tmp_path):
    proc = cli(tmp_path, "data=indexed", f"data.path={tmp_path / 'nope' / 'corpus'}", "dry_run=true")
    assert proc.returncode == 2 and "data.path" in proc.stderr and proc.stdout == ""


@pytest.mark.parametrize("override, line", [
    ("trainig.lr=1", "refused: unknown key trainig in trainig.lr=1; did you mean training.lr=1?"),
    ("parallelism.tpp=2", "refused: unknown key parallelism.tpp in parallelism.tpp=2; did you mean parallelism.tp=2?"),
    ("modle=7b", "refused: unknown key modle in modle=7b; did you mean model=7b?"),
    ("model=7bb", "refused: unknown choice model=7bb; did you mean model=7b? (choices: 1.3b, "),
    ("parallelism.tp=abc", "refused: parallelism.tp=abc: Value 'abc' of type 'str' could not be converted to Integer"),
    ("run.name=héllo wörld", "refused: cannot parse the override 'run.name=héllo wörld' (LexerNoViableAltException"),
    ("run.name=a=b=", "refused: cannot parse the override 'run.name=a=b='"),
    ("parallelism.tp=[1", "refused: cannot parse the override 'parallelism.tp=[1'"),
    ("cluster.env.NCCL_DEBUG=INFO", "refused: cluster.env.NCCL_DEBUG is a new key of the map cluster.env: add it with "
                                    "+cluster.env.NCCL_DEBUG=INFO"),
    ("cluster.sbatch_extra.qos=high", "refused: cluster.sbatch_extra.qos is a new key of the map cluster.sbatch_extra: "
                                      "add it with +cluster.sbatch_extra.qos=high"),
])
def test_a_hydra_override_error_is_one_line_with_exit_2(tmp_path, override, line):
    proc = cli(tmp_path, override, "dry_run=true", env={"HYDRA_FULL_ERROR": ""})
    assert proc.returncode == 2 and proc.stdout == ""
    (got,) = proc.stderr.splitlines()
    assert got.startswith(line), got
    assert "use +" not in got and "Set the environment" not in got
    assert list(tmp_path.iterdir()) == [tmp_path / "bin"]  # nothing written (the fake sbatch's PATH dir only)


def test_a_tokenizer_directory_is_not_called_missing(tmp_path):
    from launch.tokenizer import TokenizerError, get_tokenizer

    (tmp_path / "tok").mkdir()
    with pytest.raises(TokenizerError, match="is a directory, not a tokenizer file; name the tokenizer.json file"):
        get_tokenizer(f"hf:{tmp_path / 'tok'}")
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match=f"did you mean hf:{tmp_path / 'tok' / 'tokenizer.json'}"):
        get_tokenizer(f"hf:{tmp_path / 'tok'}")


def test_plan_gives_the_same_one_line_for_a_typo(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "plan.py"), "parallelism.tpp=2"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "refused: unknown key parallelism.tpp in parallelism.tpp=2; did you mean parallelism.tp=2?\n"


def _sweep_rows(stderr: str) -> dict[str, str]:
    table = stderr.split(" member(s)\n", 1)[1].splitlines()
    return {row.split()[0]: row for row in table[1:] if row.strip() and not row.startswith(("registry", "status",
                                                                                           "sweep "))}


def test_a_sweep_that_refuses_every_member_exits_2(tmp_path):
    # the tiny model (4 heads, gbs 8) has no valid tp x pp layout on 128 GPUs
    proc = cli(tmp_path, "-m", "cluster=lustre", "parallelism.tp=2,4,8", "parallelism.pp=1,2", "dry_run=true")
    assert proc.returncode == 2
    rows = _sweep_rows(proc.stderr)
    assert len(rows) == 6 and all(" refused " in r for r in rows.values()), rows
    assert proc.stderr.rstrip().splitlines()[-1].endswith("no member was accepted (6 refused or failed); exit 2")


def test_the_readme_sweep_with_a_model_that_fits_every_layout_exits_0(tmp_path):
    proc = cli(tmp_path, "-m", "cluster=lustre", "model=7b", "parallelism.tp=2,4,8", "parallelism.pp=1,2",
               "dry_run=true")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = _sweep_rows(proc.stderr)
    assert len(rows) == 6 and all(" ok (dry run) " in r for r in rows.values()), rows


def test_the_sweep_table_marks_a_layout_over_the_gpus_memory(tmp_path):
    proc = cli(tmp_path, "-m", "cluster=lustre", "model=30b", "parallelism.tp=2", "parallelism.pp=1,2",
               "dry_run=true")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = _sweep_rows(proc.stderr)
    over, under = rows["30b_pp1"], rows["30b_pp2"]  # named by the swept key only
    gib = float(over.split(" GiB/GPU")[0].split()[-1])
    assert gib > 80 and " may not fit (dry run) " in over, over
    assert float(under.split(" GiB/GPU")[0].split()[-1]) < 80 and " ok (dry run) " in under, under


def test_a_sweep_whose_every_submission_fails_exits_2_and_leaves_nothing(tmp_path):
    proc = cli(tmp_path, "-m", "cluster=lustre", "model=7b", "parallelism.tp=2,4", "force=true",
               f"cluster.run_root={tmp_path / 'runs'}", env={"FAKE_SBATCH_FAIL": "1"})
    assert proc.returncode == 2
    rows = _sweep_rows(proc.stderr)
    assert len(rows) == 2 and all(" failed " in r for r in rows.values()), rows
    assert [p for p in _runs(tmp_path) if not p.startswith("sweeps")] == []
