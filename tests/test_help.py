"""``--help`` lists only choices a user can pick, and every listed choice composes into a typed Job."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from launch.compose import CONFIG_DIR, to_job
from launch.config import Job, register_configs

PRETRAIN = Path(__file__).resolve().parent.parent / "launch" / "pretrain.py"


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
    proc = subprocess.run([sys.executable, str(PRETRAIN), "--help"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
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
