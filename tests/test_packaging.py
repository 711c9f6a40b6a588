"""Packaging: the base install is the login side (no torch, no Megatron-Core); ranks add ``[train]``.

The metadata test builds the package's core metadata with setuptools (the backend pip uses) in a
copy of the project, so it reads what pip would install. The ``install`` test creates a fresh
virtual environment (no system site-packages), installs only the base package into it and runs
the three login-node entry points there; pip reads the machine's pip configuration (local wheel
folders and indexes), so it needs no network where those hold the wheels.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "slurm_run"
TRAIN_ONLY = {"torch", "megatron-core", "psutil", "safetensors"}


def _requirements(metadata: str) -> tuple[set[str], dict[str, set[str]]]:
    """(base requirement names, {extra: names}) from a METADATA file's Requires-Dist lines."""
    msg = Parser().parsestr(metadata)
    base: set[str] = set()
    extras: dict[str, set[str]] = {e: set() for e in msg.get_all("Provides-Extra") or []}
    for line in msg.get_all("Requires-Dist") or []:
        req = Requirement(line)
        marker = str(req.marker or "")
        hit = [e for e in extras if f'extra == "{e}"' in marker]
        if hit:
            extras[hit[0]].add(req.name if not req.extras else f"{req.name}[{','.join(sorted(req.extras))}]")
        else:
            base.add(req.name)
    return base, extras


@pytest.fixture(scope="module")
def metadata(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Core metadata built by setuptools' PEP 517 hook in a copy of the project."""
    src = tmp_path_factory.mktemp("project")
    shutil.copy(REPO / "pyproject.toml", src)
    shutil.copy(REPO / "LICENSE", src)
    for pkg in ("launch", "train", "recovery", "analysis"):
        shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    out = src / "meta"
    out.mkdir()
    code = ("import sys; from setuptools import build_meta as b; "
            "print(b.prepare_metadata_for_build_wheel(sys.argv[1]))")
    proc = subprocess.run([sys.executable, "-c", code, str(out)], cwd=src, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return (out / proc.stdout.strip().splitlines()[-1] / "METADATA").read_text()


def test_torch_and_megatron_core_are_not_base_dependencies(metadata: str) -> None:
    base, extras = _requirements(metadata)
    assert not base & TRAIN_ONLY, f"base install pulls {sorted(base & TRAIN_ONLY)}"
    assert {"hydra-core", "omegaconf", "submitit", "pandas", "pyarrow", "matplotlib"} <= base
    assert TRAIN_ONLY <= extras["train"]
    # pytest-xdist: -n 2 --dist loadgroup (docs/quickstart.md) with the groups of tests/xdist_groups.py
    assert "slurmtron[train]" in extras["test"]
    assert {"pytest", "pytest-timeout", "pytest-xdist", "hypothesis"} <= extras["test"]


def test_train_extra_is_a_range_and_the_cpu_constraints_pin_it(metadata: str) -> None:
    msg = Parser().parsestr(metadata)
    specs = {Requirement(r).name: Requirement(r).specifier for r in msg.get_all("Requires-Dist")
             if 'extra == "train"' in r}
    assert not any(s.operator == "==" for s in specs["torch"]) and len(specs["torch"]) == 2
    pins = {Requirement(r).name: Requirement(r).specifier
            for r in (REPO / "constraints" / "cpu.txt").read_text().splitlines() if r and not r.startswith("#")}
    for name in ("torch", "megatron-core"):
        (pin,) = list(pins[name])
        assert pin.operator == "==" and specs[name].contains(pin.version), (name, pin, specs[name])


def test_the_test_tools_and_pandas_are_pinned_within_their_ranges(metadata: str) -> None:
    """CI installs the exact versions it was green with (tests/xdist_groups.py depends on pytest-xdist's way of
    grouping, which pytest 9.2 changed); the extras state the tested ranges, each pin inside its range."""
    msg = Parser().parsestr(metadata)
    specs = {Requirement(r).name: Requirement(r).specifier for r in msg.get_all("Requires-Dist")}
    pins = {Requirement(r).name: Requirement(r).specifier
            for r in (REPO / "constraints" / "cpu.txt").read_text().splitlines() if r and not r.startswith("#")}
    for name in ("pytest", "pytest-xdist", "pytest-timeout", "hypothesis", "pandas"):
        (pin,) = list(pins[name])
        assert pin.operator == "==" and specs[name].contains(pin.version), (name, pin, specs[name])
        assert any(s.operator == "<" for s in specs[name]), f"{name} has no upper bound: {specs[name]}"
    assert "execnet" in pins  # pytest-xdist's transport, pinned with it


def test_the_license_is_apache_2_and_ships(metadata: str) -> None:
    msg = Parser().parsestr(metadata)
    assert msg["License-Expression"] == "Apache-2.0" and msg.get_all("License-File") == ["LICENSE"]
    text = (REPO / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Copyright 2026 The slurmtron authors" in text


def test_export_extra_is_in_the_test_extra_and_off_the_base(metadata: str) -> None:
    base, extras = _requirements(metadata)
    assert {"transformers", "safetensors"} <= extras["export"] and not base & {"transformers", "safetensors"}
    assert "slurmtron[export]" in extras["test"]


def test_readme_commands_and_ci_agree() -> None:
    """.ci/run runs the README's two commands, as written and in order (the first in a fresh venv)."""
    readme = (REPO / "README.md").read_text()
    ci = [ln.strip() for ln in (REPO / ".ci" / "run").read_text().splitlines()]
    quick = readme.split("## Quickstart", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [ln.strip() for ln in quick.splitlines() if ln.strip() and not ln.startswith("#")]
    assert len(commands) == 2
    assert all(c in ci for c in commands), (commands, ci)
    assert ci.index(commands[0]) < ci.index(commands[1])
    assert ci[ci.index(commands[0]) - 1] == '. "$venv/bin/activate"'
    assert all("-c constraints/cpu.txt" in c for c in commands)


# ---- a fresh virtual environment with only the base install -------------------------------------

@pytest.fixture(scope="module")
def base_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One venv per session: ``pip install -e .`` without extras, as on a login node."""
    root = tmp_path_factory.mktemp("venv") / "login"
    venv.EnvBuilder(with_pip=True, system_site_packages=False, clear=True).create(root)
    python = root / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "-e", str(REPO)], capture_output=True,
                          text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return python


def _run(python: Path, args: list, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return subprocess.run([str(python), *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env=env)


@pytest.mark.install
def test_the_base_venv_has_no_torch_and_no_megatron(base_venv: Path, tmp_path: Path) -> None:
    proc = _run(base_venv, ["-c", "import importlib.util as u; print(u.find_spec('torch'), "
                                  "u.find_spec('megatron'), u.find_spec('hydra'))"], tmp_path)
    none_torch, none_megatron, hydra = proc.stdout.split(maxsplit=2)
    assert (none_torch, none_megatron) == ("None", "None") and hydra.startswith("ModuleSpec"), proc.stdout


@pytest.mark.install
def test_dry_run_from_the_base_venv(base_venv: Path, tmp_path: Path) -> None:
    proc = _run(base_venv, [REPO / "launch" / "pretrain.py", "cluster=lustre", "model=7b", "dry_run=true",
                            f"cluster.run_root={tmp_path}", "run.name=login-venv"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "#SBATCH --requeue" in proc.stdout and "-m train.worker" in proc.stdout


@pytest.mark.install
def test_plan_from_the_base_venv(base_venv: Path, tmp_path: Path) -> None:
    proc = _run(base_venv, [REPO / "launch" / "plan.py", "model=7b", "cluster=lustre", "plan.format=json"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout)
    assert plan["fits"] is True and 0 < plan["mfu"] < 1


@pytest.mark.install
def test_report_from_the_base_venv(base_venv: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    proc = _run(base_venv, [REPO / "analysis" / "report.py", FIXTURE, "--out", out], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary and (out / "report.md").exists() and (out / "iterations.csv").exists()
