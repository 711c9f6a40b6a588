"""train/versions.py: a rank refuses, in one line and with a final exit code, to run on a torch or
Megatron-Core outside the tested ranges (and fp8 without TransformerEngine)."""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from recovery.crash import crashed, requeue_after_crash
from recovery.events import read_events
from recovery.policy import EXIT_UNSUPPORTED
from train import versions

REPO = Path(__file__).resolve().parent.parent


def fake_metadata(monkeypatch: pytest.MonkeyPatch, **fake: str) -> None:
    """importlib.metadata.version answering ``fake`` (names with '_' for '-') and the truth otherwise."""
    real = importlib.metadata.version
    table = {k.replace("_", "-"): v for k, v in fake.items()}
    monkeypatch.setattr(importlib.metadata, "version", lambda dist: table.get(dist) or real(dist))


def test_the_installed_versions_pass() -> None:
    assert versions.refusal() is None


def test_an_older_megatron_core_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys) -> None:
    fake_metadata(monkeypatch, megatron_core="0.15.2")
    env = {"SLURM_JOB_ID": "91", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_RESTART_COUNT": "2"}
    code = versions.refuse_unsupported(tmp_path, env, "bf16")
    assert code == EXIT_UNSUPPORTED == 10
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    line = err.strip()
    assert "megatron-core 0.15.2 is outside >=0.16.1,<0.17" in line
    assert f"torch {importlib.metadata.version('torch')}" in line  # what was found, both of them
    assert "supported torch>=2.11,<2.14, megatron-core>=0.16.1,<0.17" in line
    # recorded as a final decision: the batch script's crash path does not requeue it
    events = read_events(tmp_path / "events.jsonl")
    assert [(e["event"], e["reason"], e["code"]) for e in events] == [
        ("stop", "unsupported_software", 10), ("exit", "unsupported_software", 10)]
    assert events[0]["job_id"] == "91" and events[0]["restart_count"] == 2
    again, why = crashed(events)
    assert not again and "unsupported_software" in why
    calls = []
    assert requeue_after_crash(tmp_path, env, lambda argv, **k: calls.append(argv))[0] == 0 and calls == []


def test_a_newer_torch_and_a_missing_core_are_both_named() -> None:
    line = versions.refusal(version_of={"torch": "2.14.0"}.get,
                            importable=lambda m: m != "megatron.core")
    assert line is not None and "\n" not in line
    assert "megatron-core is not importable (import megatron.core)" in line
    assert "torch 2.14.0 is outside >=2.11,<2.14" in line
    assert "found torch 2.14.0, megatron-core missing" in line


@pytest.mark.parametrize("version,ok", [
    ("2.11.0", True), ("2.11.0a0+ecf3bae40a", True),  # an NGC image's torch counts as its release
    ("2.13.0+cpu", True), ("2.10.1", False), ("2.14.0", False), ("2.14.0a0+git", False), ("junk", False),
])
def test_torch_range_by_release_number(version: str, ok: bool) -> None:
    assert versions.in_range(version, versions.SUPPORTED["torch"]) is ok


def test_module_version_is_used_without_metadata() -> None:
    """A Megatron-LM checkout on PYTHONPATH has no package metadata, only megatron.core.__version__."""
    assert versions.refusal(version_of=lambda d: None, module_version={"torch": "2.12.1",
                                                                       "megatron.core": "0.16.9"}.get) is None
    line = versions.refusal(version_of=lambda d: None, module_version=lambda m: None)
    assert "torch has no version" in line and "megatron-core has no version" in line


def test_fp8_without_transformer_engine_is_refused(tmp_path: Path, capsys) -> None:
    assert "fp8 is not supported by this worker yet" in versions.refusal("fp8", have_te=lambda: True)
    assert versions.refusal("bf16", have_te=lambda: False) is None
    code = versions.refuse_unsupported(tmp_path, {"RANK": "1", "WORLD_SIZE": "2"}, "fp8", have_te=lambda: False)
    assert code == EXIT_UNSUPPORTED
    assert "training.precision=fp8 needs TransformerEngine" in capsys.readouterr().err
    assert not (tmp_path / "events.jsonl").exists()  # only rank 0 writes the event log


def test_the_worker_refuses_an_older_core_through_its_entry_point(tmp_path: Path) -> None:
    """``python -m train.worker RUN_DIR`` with an older megatron-core's metadata first on the path."""
    from launch.compose import compose_job, job_to_yaml

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(job_to_yaml(compose_job(["model=tiny"])))
    fake = tmp_path / "fake" / "megatron_core-0.15.0.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: megatron-core\nVersion: 0.15.0\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), str(REPO)]),
           "RANK": "0", "WORLD_SIZE": "1", "SLURM_JOB_ID": "5", "SLURM_RESTART_COUNT": "0"}
    proc = subprocess.run([sys.executable, "-m", "train.worker", str(run_dir)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_UNSUPPORTED, proc.stderr[-2000:]
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, lines
    assert "megatron-core 0.15.0 is outside >=0.16.1,<0.17" in lines[0]
    events = read_events(run_dir / "events.jsonl")
    assert [e["reason"] for e in events] == ["unsupported_software"] * 2
    assert requeue_after_crash(run_dir, {"SLURM_JOB_ID": "5"}, lambda *a, **k: pytest.fail("requeued"))[0] == 0


@pytest.mark.parametrize("override,says", [
    ("training.precision=fp8", "training.precision=fp8 needs TransformerEngine"),
    ("parallelism.tp_comm_overlap=true", "parallelism.tp_comm_overlap=true needs TransformerEngine's userbuffers"),
])
def test_the_worker_refuses_what_needs_transformer_engine_at_start(tmp_path: Path, override: str, says: str) -> None:
    """Without TransformerEngine (this machine has none) the worker's entry point refuses fp8 and TP
    communication overlap in one line with exit 10, never downgrading to bf16, and the crash path does not
    requeue the attempt."""
    from launch.compose import compose_job, job_to_yaml

    assert not versions.have_transformer_engine()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(job_to_yaml(compose_job(["model=tiny", override])))
    env = {**os.environ, "PYTHONPATH": str(REPO), "RANK": "0", "WORLD_SIZE": "1", "SLURM_JOB_ID": "6",
           "SLURM_RESTART_COUNT": "0"}
    proc = subprocess.run([sys.executable, "-m", "train.worker", str(run_dir)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_UNSUPPORTED == 10, proc.stderr[-2000:]
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, lines
    assert says in lines[0] and "fix:" in lines[0]
    events = read_events(run_dir / "events.jsonl")
    assert [(e["event"], e["reason"], e["code"]) for e in events] == [
        ("stop", "unsupported_software", 10), ("exit", "unsupported_software", 10)]
    assert not any(e["event"] in ("job_start", "iteration") for e in events)  # nothing trained in another precision
    assert requeue_after_crash(run_dir, {"SLURM_JOB_ID": "6"}, lambda *a, **k: pytest.fail("requeued"))[0] == 0


def test_the_train_extra_states_the_same_ranges() -> None:
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]
    reqs = {Requirement(r).name: str(Requirement(r).specifier) for r in extra}
    for dist, spec in versions.SUPPORTED.items():
        assert reqs[dist] == str(Requirement(f"x{spec}").specifier), dist
