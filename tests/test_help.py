"""``--help`` of every entry point is a short usage (exit 0); ``--help-config`` lists only choices a user
can pick, and every listed choice composes into a typed Job."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hydra import compose, initialize_config_dir

from launch.compose import CONFIG_DIR, to_job
from launch.config import Job, register_configs

REPO = Path(__file__).resolve().parent.parent
PRETRAIN = REPO / "launch" / "pretrain.py"


def listed_choices(help_text: str) -> dict[str, list[str]]:
    """The ``group: a, b, c`` lines of Hydra's "Configuration groups" section."""
    section = help_text.split("== Configuration groups ==", 1)[1].split("== Config ==", 1)[0]
    out = {}
    for line in section.splitlines():
        group, sep, options = line.partition(": ")
        if sep and " " not in group:
            out[group] = [o.strip() for o in options.split(",") if o.strip()]
    return out


def test_help_lists_only_choices_that_compose(tmp_path):
    proc = subprocess.run([sys.executable, str(PRETRAIN), "--help-config"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    choices = listed_choices(proc.stdout)
    assert set(choices) == {"cluster", "data", "model", "parallelism", "training"}, choices
    # every YAML file of a group is offered, and nothing else (the schema nodes are not options)
    for group, options in choices.items():
        assert sorted(options) == sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml")), group
    assert "base_" not in proc.stdout.split("== Config ==")[0] and "schema_" not in proc.stdout
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        for group, options in choices.items():
            for option in options:
                job = to_job(compose(config_name="config", overrides=[f"{group}={option}"]))
                assert isinstance(job, Job)
                # the pick took effect: the group's node carries the option's values
                name = getattr(getattr(job, group), "name", None)
                if name is not None and group != "data":
                    assert name == option, (group, option, name)


ENTRY_POINTS = {  # name -> argv after the interpreter; what its usage must mention
    "pretrain": ([str(PRETRAIN)], ["dry_run=true", "-m", "--help-config", "model="]),
    "plan": ([str(REPO / "launch" / "plan.py")], ["plan.top", "parallelism=auto", "--help-config"]),
    "preflight": ([str(REPO / "launch" / "preflight.py")], ["preflight.steps", "preflight.json"]),
    "status": ([str(REPO / "launch" / "status.py")], ["--watch", "--json", "SWEEP_ID"]),
    "stop": ([str(REPO / "launch" / "stop.py")], ["run.name=NAME", "at_step=N", "3 the run is already complete"]),
    "preprocess": (["-m", "launch.preprocess"], ["--input", "--output-prefix", "--tokenizer"]),
    "report": ([str(REPO / "analysis" / "report.py")], ["--out", "report.md"]),
    "resume": (["-m", "recovery.resume"], ["CHECKPOINT_ROOT", "3 it would refuse"]),
    "export": (["-m", "train.export"], ["--out", "--step", "5 no verified checkpoint"]),
}


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_every_entry_point_has_a_short_usage_and_exits_0(tmp_path, name, flag):
    argv, mentions = ENTRY_POINTS[name]
    proc = subprocess.run([sys.executable, *argv, flag], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = proc.stdout
    assert text.startswith("usage:") and proc.stderr == "", (text[:300], proc.stderr[-500:])
    assert "docs/" in text and "exit codes" in text  # where to read more, and what the status means
    assert len(text.splitlines()) <= 40, len(text.splitlines())
    for word in mentions:
        assert word in text, (name, word)
    assert list(tmp_path.iterdir()) == []  # --help is never taken for a run directory or written anywhere


def test_pretrain_and_plan_help_say_different_things(tmp_path):
    texts = [subprocess.run([sys.executable, *ENTRY_POINTS[n][0], "--help"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120).stdout for n in ("pretrain", "plan")]
    assert texts[0].splitlines()[0] != texts[1].splitlines()[0] and "== Config ==" not in texts[0] + texts[1]
