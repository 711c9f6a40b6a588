"""The rendered sbatch script: golden files per cluster profile, ``bash -n``, and quoting fuzz.

Refresh the golden files after an intended change with
``SLURMTRON_UPDATE_GOLDEN=1 pytest tests/test_render.py`` and review the diff in git.
"""
from __future__ import annotations

import difflib
import functools
import json
import os
import shlex
import stat
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launch.check import check
from launch.compose import CONFIG_DIR, compose_job
from launch.render import read_failed_nodes, render

GOLDEN_DIR = Path(__file__).parent / "golden"
UPDATE = os.environ.get("SLURMTRON_UPDATE_GOLDEN") == "1"
RUN_DIR = "/runs/golden"
CODE_DIR = "/opt/slurmtron"
# The model each cluster profile is rendered with (a valid pair); other Slurm profiles use tiny.
PROFILE_MODEL = {"lustre": "30b", "container": "7b", "slurm_local": "tiny"}
PROFILE_OVERRIDES = {"slurm_local": ["run.time_limit_min=10"]}  # its partition allows 30 minutes


def slurm_profiles() -> list[str]:
    """Every cluster profile except the local launcher (which is not rendered as sbatch)."""
    names = sorted(p.stem for p in (CONFIG_DIR / "cluster").glob("*.yaml"))
    return [n for n in names if compose_job([f"cluster={n}", "model=tiny"]).cluster.launcher == "slurm"]


def golden_job(profile: str):
    return compose_job([f"cluster={profile}", f"model={PROFILE_MODEL.get(profile, 'tiny')}", "run.name=golden",
                        f"run.dir={RUN_DIR}", *PROFILE_OVERRIDES.get(profile, [])])


def bash_n(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, timeout=30)


def sbatch_directives(script: str) -> dict[str, str | bool]:
    """Parse ``#SBATCH --key=value`` lines back with shell-word rules (as sbatch does)."""
    out: dict[str, str | bool] = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            (word,) = shlex.split(line[len("#SBATCH "):])
            key, _, value = word.removeprefix("--").partition("=")
            out[key] = value if _ else True
    return out


@pytest.mark.parametrize("profile", slurm_profiles())
def test_golden_script(profile):
    job = golden_job(profile)
    assert check(job) == [], "the golden job must be valid"
    script = render(job, RUN_DIR, failed_nodes=[], code_dir=CODE_DIR)
    path = GOLDEN_DIR / f"sbatch_{profile}.sh"
    if UPDATE:
        GOLDEN_DIR.mkdir(exist_ok=True)
        path.write_text(script)
    if not path.exists():
        pytest.fail(f"no golden file {path.name}; create it with: SLURMTRON_UPDATE_GOLDEN=1 pytest tests/test_render.py")
    expected = path.read_text()
    if script != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), script.splitlines(True),
                                            f"golden/{path.name}", "rendered"))
        pytest.fail(f"rendered script differs from the golden file (submitit drift or a template change?).\n"
                    f"If the change is intended: SLURMTRON_UPDATE_GOLDEN=1 pytest tests/test_render.py\n{diff}")


@pytest.mark.parametrize("profile", slurm_profiles())
def test_rendered_script_passes_bash_n_and_carries_the_requeue_contract(profile):
    job = golden_job(profile)
    script = render(job, RUN_DIR, failed_nodes=[], code_dir=CODE_DIR)
    assert bash_n(script).returncode == 0, bash_n(script).stderr
    d = sbatch_directives(script)
    c = job.cluster
    assert d["signal"] == f"USR2@{job.training.signal_lead_time_s}"  # no B: the tasks get it
    assert ("requeue" in d) == c.requeue_allowed and ("no-requeue" in d) != c.requeue_allowed
    assert d["open-mode"] == "append"
    assert d["nodes"] == str(c.nodes) and d["ntasks-per-node"] == str(c.gpus_per_node)
    assert d["cpus-per-task"] == str(c.cpus_per_node // c.gpus_per_node)
    assert d["time"] == str(job.run.time_limit_min) and d["job-name"] == "golden"
    assert d["output"] == f"{RUN_DIR}/logs/%j_batch.out"
    for key, value in (("partition", c.partition), ("account", c.account), ("qos", c.qos)):
        assert d.get(key) == (value or None)
    srun = [line for line in script.splitlines() if line.startswith("srun ")]
    assert len(srun) == 1
    words = shlex.split(srun[0])
    assert "--kill-on-bad-exit=1" in words and f"--output={RUN_DIR}/logs/%j_%t.out" in words
    assert words[-5:] == [c.python, "-u", "-m", "train.worker", "$RUN_DIR"]
    assert "torchrun" not in script.replace("Why no torchrun", "")
    assert ("lfs setstripe" in script) == (c.lustre_stripe_count > 0)
    assert ("--container-image=" in srun[0]) == bool(c.container.image)
    for module in c.modules:
        assert f"module load {shlex.quote(module)}" in script


def test_optional_flags_and_failed_nodes(tmp_path):
    job = compose_job(["cluster=lustre", "model=7b", "run.name=x", "cluster.exclude='n7,n8'", "cluster.account=proj",
                       "cluster.partition=", "cluster.qos="])
    (tmp_path / "failed_nodes.json").write_text(json.dumps(
        [{"host": "n9", "reason": "ecc"}, {"host": "n7", "reason": "dup"}, {"host": "bad host; rm -rf /"}, 3]))
    assert read_failed_nodes(tmp_path) == ["n9", "n7"]
    d = sbatch_directives(render(job, tmp_path, dependency="afterany:41"))
    assert d["exclude"] == "n7,n8,n9"
    assert d["dependency"] == "afterany:41" and d["account"] == "proj"
    assert "partition" not in d and "qos" not in d


@pytest.mark.parametrize("content", ["", "{not json", '{"host": "n1"}', "[1, null]"])
def test_failed_nodes_file_is_read_tolerantly(tmp_path, content):
    (tmp_path / "failed_nodes.json").write_text(content)
    assert read_failed_nodes(tmp_path) == []


def test_cpu_cluster_asks_for_no_gpus():
    job = compose_job(["cluster=lustre", "model=tiny", "cluster.gpu=cpu", "cluster.gpus_per_node=2",
                       "cluster.nodes=1", "training.precision=fp32", "run.dir=/r"])
    assert "gpus-per-node" not in sbatch_directives(render(job, "/r", failed_nodes=[]))


# ---- quoting fuzz: config strings that would run code if they were not quoted -------------------------------

CANARY = "CANARY"
NASTY = [f"$(touch {CANARY})", f"`touch {CANARY}`", f"a'; touch {CANARY}; '", f'"; touch {CANARY}; "',
         "a'; echo foo", "with space", "$HOME", "${PATH}", "\\", "*", "~", "!x", "a\"b", "#", ";", "&&", "|", ">x"]
nasty_text = st.lists(st.one_of(st.sampled_from(NASTY), st.text("ab_-. '\"$`\\!", max_size=4)),
                      min_size=1, max_size=4).map("".join)
with_newlines = st.lists(st.one_of(nasty_text, st.just("\n")), min_size=1, max_size=3).map("".join)

STUBS = {
    "scontrol": '#!/bin/sh\ncase "$2" in hostnames) echo n1;; node) echo "NodeName=n1 NodeAddr=127.0.0.1 x=y";; '
                'esac\n',
    "lfs": '#!/bin/sh\nprintf "%s\\n" "lfs $*" >> "$STUB_LOG"\n',
    "module": '#!/bin/sh\nprintf "%s\\n" "module $*" >> "$STUB_LOG"\n',
    "srun": '#!/usr/bin/env python3\nimport json, os, sys\n'
            'json.dump({"argv": sys.argv[1:], "env": dict(os.environ)}, open(os.environ["SRUN_RECORD"], "w"))\n',
}


def _stub_dir(root: Path) -> Path:
    bin_dir = root / "stubbin"
    bin_dir.mkdir()
    for name, body in STUBS.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IEXEC)
    return bin_dir


@functools.lru_cache(maxsize=1)
def _fuzz_base():
    return compose_job(["cluster=lustre", "model=7b", "run.dir=/r"])


def _fuzzed_job(name, path_part, partition, env_value, module, image, mount, python):
    job = _fuzz_base()
    c = job.cluster
    cluster = replace(c, partition=partition, account=partition, qos=partition, modules=[module],
                      env={**c.env, "FUZZ_VALUE": env_value}, python=python, exclude=path_part,
                      checkpoint_root=f"ck {path_part}", lustre_stripe_size=path_part,
                      container=replace(c.container, image=image, mounts=[mount], workdir=path_part))
    return replace(job, cluster=cluster, run=replace(job.run, name=name))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=with_newlines.filter(lambda s: s and "/" not in s and s not in (".", "..")), path_part=nasty_text,
       partition=with_newlines, env_value=with_newlines, module=nasty_text, image=nasty_text.filter(bool),
       mount=nasty_text.filter(lambda s: "," not in s), python=nasty_text.filter(lambda s: s.strip()))
def test_config_strings_are_quoted_and_never_executed(name, path_part, partition, env_value, module, image, mount,
                                                      python):
    job = _fuzzed_job(name, path_part, partition, env_value, module, image, mount, python)
    refused = {p.field for p in check(job) if "newline" in p.arithmetic}
    multi_line = {f for f, v in (("run.name", name), ("cluster.partition", partition)) if "\n" in v}
    assert multi_line <= refused  # a value that cannot hold a newline is refused, not rendered
    if multi_line:
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run_dir = f"runs/{path_part}"
        script = render(job, run_dir, failed_nodes=[], code_dir=f"/opt/{path_part}")
        assert bash_n(script).returncode == 0, script
        env = {"PATH": f"{_stub_dir(root)}:/usr/bin:/bin", "SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "n1",
               "STUB_LOG": str(root / "stub.log"), "SRUN_RECORD": str(root / "srun.json"), "HOME": str(root)}
        (root / "work").mkdir()
        proc = subprocess.run(["bash", "-c", script], cwd=root / "work", env=env, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert not any(p.name == CANARY for p in root.rglob("*")), "an injected command ran"
        assert "foo" not in proc.stdout.splitlines()  # `a'; echo foo` stayed text
        record = json.loads((root / "srun.json").read_text())
        argv, env_seen = record["argv"], record["env"]
        assert argv[-5:] == [python, "-u", "-m", "train.worker", run_dir]  # each value arrives as one word
        assert f"--container-image={image}" in argv and f"--container-mounts={mount}" in argv
        assert env_seen["FUZZ_VALUE"] == env_value and env_seen["MASTER_ADDR"] == "127.0.0.1"
        assert env_seen["PYTHONPATH"].startswith(f"/opt/{path_part}")
        stub_log = (root / "stub.log").read_text()
        assert f"module load {module}\n" in stub_log
        assert f"lfs setstripe -c 8 -S {path_part} ck {path_part}/{name}\n" in stub_log
        assert sbatch_directives(script)["job-name"] == name
