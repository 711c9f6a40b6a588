"""Config per component (issue 29): ``training.watchdog``, ``training.nan_guard``, ``training.stragglers`` and
``cluster.planner`` are nested dataclasses; the choice fields are typed and still reported in ``check()``'s one
list; a config of the old flat shape (a run's saved ``config.yaml``, an override) still loads, with one WARNING."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launch.check import check
from launch.cli import _yaml_key_line
from launch.compose import MOVED, compose_job, job_to_yaml, load_job, migrate_overrides
from launch.config import CHOICES, allowed_values
from train.worker import _load_run

REPO = Path(__file__).resolve().parent.parent
LOCAL = ["cluster=local", "model=tiny"]
# non-default values at every moved place, so reading one back from its old key shows
NEW = ["training.watchdog.enabled=false", "training.watchdog.startup_s=240", "training.watchdog.step_factor=4",
       "training.watchdog.step_floor_s=30", "training.watchdog.save_factor=2", "training.watchdog.save_floor_s=90",
       "training.nan_guard.on_nan=rollback", "training.nan_guard.skip_batches=2", "training.nan_guard.max_rollbacks=5",
       "training.nan_guard.hooks=true", "training.stragglers.interval=7", "training.stragglers.threshold=0.3",
       "training.stragglers.regression_threshold=0.4", "training.stragglers.regression_intervals=4",
       "cluster.planner.achievable_fraction=0.6", "cluster.planner.nvlink_latency_us=2.5",
       "cluster.planner.ib_latency_us=12", "cluster.planner.kernel_launch_us=5", "cluster.planner.step_overhead_s=0.05",
       "cluster.planner.step_jitter=0.02"]


def _field(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _old_shape(text: str) -> str:
    """A saved config.yaml as the version before the split wrote it: the moved keys flat in their group."""
    cfg = yaml.safe_load(text)
    for old, new in MOVED.items():
        group, key = old.split(".")
        _, sub, name = new.split(".")
        cfg[group][key] = cfg[group][sub][name]
    for sub in ("watchdog", "nan_guard", "stragglers"):
        del cfg["training"][sub]
    del cfg["cluster"]["planner"]
    return yaml.safe_dump(cfg, sort_keys=False)


def test_every_moved_key_has_a_new_place_and_no_old_one():
    job = compose_job(LOCAL)
    for old, new in MOVED.items():
        _field(job, new)  # exists
        with pytest.raises(AttributeError):
            _field(job, old)
    assert len(MOVED) == 20 and set(new.rsplit(".", 1)[0] for new in MOVED.values()) == {
        "training.watchdog", "training.nan_guard", "training.stragglers", "cluster.planner"}


def test_a_run_saved_in_the_old_shape_loads_on_the_ranks_with_one_warning(tmp_path):
    job = compose_job(LOCAL + NEW + [f"run.dir={tmp_path}"])
    old = _old_shape(job_to_yaml(job))
    assert "hang_step_floor_s: 30" in old and "  watchdog:" not in old and "  planner:" not in old
    (tmp_path / "config.yaml").write_text(old)
    said: list[str] = []
    loaded = _load_run(str(tmp_path), {}, lambda path: load_job(path, warn=said.append))
    assert not isinstance(loaded, int), "the worker refused a config of the old shape"
    back, paths = loaded
    assert back == job and paths.run_dir == job.paths_at(tmp_path).run_dir
    assert len(said) == 1 and said[0].startswith("WARNING: ")
    for old_key, new_key in MOVED.items():
        assert f"{old_key} -> {new_key}" in said[0]


def test_the_new_key_wins_over_an_old_one_left_beside_it(tmp_path):
    job = compose_job(LOCAL + ["training.watchdog.step_floor_s=30"])
    text = job_to_yaml(job).replace("training:\n", "training:\n  hang_step_floor_s: 99\n", 1)
    (tmp_path / "config.yaml").write_text(text)
    said: list[str] = []
    assert load_job(tmp_path / "config.yaml", warn=said.append).training.watchdog.step_floor_s == 30
    assert len(said) == 1 and "training.hang_step_floor_s -> training.watchdog.step_floor_s" in said[0]


def test_the_recorded_real_run_from_before_the_split_still_loads(capsys):
    """tests/fixtures/slurm_run was saved by real Slurm before the split (cluster.achievable_fraction flat)."""
    job = load_job(REPO / "tests" / "fixtures" / "slurm_run" / "config.yaml")
    assert job.cluster.planner.achievable_fraction == 0.7
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cluster.achievable_fraction -> cluster.planner.achievable_fraction" in err[0]


def test_an_old_override_key_is_read_at_its_new_place_with_one_warning():
    said: list[str] = []
    out = migrate_overrides(["training.hang_step_floor_s=30", "+cluster.step_jitter=0.2", "model=tiny"],
                            warn=said.append)
    assert out == ["training.watchdog.step_floor_s=30", "cluster.planner.step_jitter=0.2", "model=tiny"]
    assert len(said) == 1 and "training.hang_step_floor_s -> training.watchdog.step_floor_s" in said[0]
    assert migrate_overrides(["training.lr=1"], warn=said.append) == ["training.lr=1"] and len(said) == 1


def test_pretrain_reads_an_old_override_key_with_a_warning():
    proc = subprocess.run([sys.executable, "launch/pretrain.py", "cluster=local", "model=tiny", "dry_run=true",
                           "training.hang_step_floor_s=30"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "training.hang_step_floor_s -> training.watchdog.step_floor_s" in proc.stderr
    assert "step_floor_s: 30" in proc.stdout


def test_an_old_key_in_a_cluster_yaml_is_one_line_naming_its_new_place():
    text = ("In 'cluster/site': ConfigKeyError raised while composing config:\nKey 'step_jitter' not in "
            "'ClusterConfig'\n    full_key: cluster.step_jitter\n    object_type=ClusterConfig")
    assert _yaml_key_line(text) == ("refused: hydra_conf/cluster/site.yaml: cluster.step_jitter moved to "
                                    "cluster.planner.step_jitter; write it in that file as planner: {step_jitter: ...}")
    assert "did you mean cluster.nodes?" in _yaml_key_line(text.replace("step_jitter", "nodez"))
    assert _yaml_key_line("Could not override 'x'") == ""


def test_every_choice_field_is_typed_and_each_wrong_value_is_one_problem_with_a_did_you_mean():
    assert CHOICES["training.nan_guard.on_nan"] == ("stop", "rollback")
    assert CHOICES["training.precision"] == ("bf16", "fp16", "fp32", "fp8") and allowed_values(int) is None
    wrong = {dotted: allowed[-1][:-1] for dotted, allowed in CHOICES.items()}  # a letter short: 'rollbac'
    probs = {p.field: p for p in check(compose_job(LOCAL + [f"{k}={v}" for k, v in wrong.items()]))}
    for dotted, allowed in CHOICES.items():
        p = probs[dotted]
        assert f"did you mean {dotted}={allowed[-1]}?" in p.fix and all(a in p.fix for a in allowed)
        assert "\n" not in p.arithmetic and "\n" not in p.fix


def test_a_checkpoint_interval_that_is_no_step_count_nor_auto_is_a_problem_not_a_traceback():
    for value in ("1.5", "true", "-3", "sometimes"):
        probs = [p for p in check(compose_job(LOCAL + [f"training.checkpoint_interval={value}"]))]
        assert [p.field for p in probs] == ["training.checkpoint_interval"], value
    assert check(compose_job(LOCAL + ["training.checkpoint_interval=AUTO"])) == []

