"""Compose a typed :class:`~launch.config.Job` from overrides, outside ``@hydra.main``.

Tests, ``plan.py`` and the worker use this; ``pretrain.py`` gets the same object from
``@hydra.main`` and :func:`to_job`.
"""
from __future__ import annotations

import dataclasses
import difflib
import sys
import typing
from pathlib import Path
from typing import Any, Callable, Sequence

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from launch.config import Job, register_configs
from launch.problems import Problem

CONFIG_DIR = Path(__file__).resolve().parent.parent / "hydra_conf"


def to_job(cfg: DictConfig) -> Job:
    """Turn a composed DictConfig into the typed Job (runs each dataclass' __post_init__)."""
    job = OmegaConf.to_object(cfg)
    if not isinstance(job, Job):
        raise TypeError(f"composed config is a {type(job).__name__}, expected Job (is base_job first in defaults?)")
    return job


def unknown_keys(cfg: DictConfig) -> list[Problem]:
    """Keys the schema does not have (added with ``+key=value``), each with a "did you mean".

    Hydra refuses a plain typo (``run.nmae=x``) but suggests ``+run.nmae=x``, which it then adds
    to the struct config; ``to_object`` drops it silently. Refuse it here instead.
    """
    out: list[Problem] = []

    def walk(node: Any, cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        for key, value in node.items():
            path = f"{prefix}{key}"
            if key not in names:
                close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
                out.append(Problem(path, "is not a field of the schema (launch/config.py); it would be ignored",
                                   f"{cls.__name__} has no field {key!r}",
                                   f"did you mean {prefix}{close[0]}=...?" if close else
                                   f"drop {path}; the fields of {prefix.rstrip('.') or 'the job'} are "
                                   f"{', '.join(names)}"))
            elif dataclasses.is_dataclass(hints.get(key)) and isinstance(value, dict):
                walk(value, hints[key], f"{path}.")

    raw = OmegaConf.to_container(cfg, resolve=False)
    if isinstance(raw, dict):
        raw.pop("hydra", None)
        walk(raw, Job, "")
    return out


def config_error(exc: Exception) -> str:
    """One line for an OmegaConf error: the key and what is wrong (OmegaConf's text is multi-line)."""
    key = getattr(exc, "full_key", "") or ""
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if type(exc).__name__ == "MissingMandatoryValue":
        return f"{key}: has no value (???); set {key}=..."
    return f"{key}: {msg}" if key and key not in msg else msg


# Fields that left the schema, and where they went: a config.yaml saved before still loads.
RETIRED = {
    ("training", "fail_at_iter"): "a test hook, now the environment switch SLURMTRON_TEST_FAIL_AT_ITER",
}

# Fields that moved into a component's own config (issue 29): old dotted key -> new dotted key. A saved
# config.yaml, a command-line override or a Python caller's override with the old key is read at the new
# place, with one WARNING line naming the new keys.
MOVED = {
    **{f"training.hang_{old}": f"training.watchdog.{new}" for old, new in (
        ("watchdog", "enabled"), ("startup_s", "startup_s"), ("step_factor", "step_factor"),
        ("step_floor_s", "step_floor_s"), ("save_factor", "save_factor"), ("save_floor_s", "save_floor_s"))},
    "training.on_nan": "training.nan_guard.on_nan",
    "training.nan_skip_batches": "training.nan_guard.skip_batches",
    "training.max_nan_rollbacks": "training.nan_guard.max_rollbacks",
    "training.nan_hooks": "training.nan_guard.hooks",
    "training.straggler_interval": "training.stragglers.interval",
    "training.straggler_threshold": "training.stragglers.threshold",
    "training.regression_threshold": "training.stragglers.regression_threshold",
    "training.regression_intervals": "training.stragglers.regression_intervals",
    **{f"cluster.{name}": f"cluster.planner.{name}" for name in (
        "achievable_fraction", "nvlink_latency_us", "ib_latency_us", "kernel_launch_us", "step_overhead_s",
        "step_jitter")},
}


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


def moved_warning(where: str, moves: Sequence[tuple[str, str]]) -> str:
    """The one WARNING line for old keys read at their new places."""
    pairs = ", ".join(f"{old} -> {new}" for old, new in moves)
    return f"WARNING: {where}: old keys read at their new places: {pairs} (the schema moved them; write the new names)"


def migrate_overrides(overrides: Sequence[str], warn: Callable[[str], None] = _stderr) -> list[str]:
    """``overrides`` with every moved key (:data:`MOVED`) renamed to its new place (``+``/``~`` kept only
    for keys the schema lacks: a moved key always exists at its new place); one WARNING line if any moved."""
    out, moves = [], []
    for o in overrides:
        key, sep, value = o.partition("=")
        bare = key.lstrip("+~")
        if sep and bare in MOVED:
            moves.append((bare, MOVED[bare]))
            o = f"{'~' if key.startswith('~') else ''}{MOVED[bare]}={value}"
        out.append(o)
    if moves:
        warn(moved_warning("overrides", moves))
    return out


def compose_job(overrides: Sequence[str] = (), config_name: str = "config") -> Job:
    """Compose hydra_conf/<config_name>.yaml with ``overrides`` and return the typed Job."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=migrate_overrides(overrides))
    return to_job(cfg)


_ABSENT = object()


def migrate_saved(saved: DictConfig, where: str, warn: Callable[[str], None] = _stderr) -> None:
    """Bring a saved config of an older shape to the schema, in place: a retired field (:data:`RETIRED`) is
    dropped and a moved one (:data:`MOVED`) set at its new place (unless that is set too: the new key wins),
    each with a WARNING line through ``warn``."""
    for (group, key), why in RETIRED.items():
        node = saved.get(group)
        if isinstance(node, DictConfig) and key in node:
            warn(f"WARNING: {where}: ignoring {group}.{key}={node[key]!r}, no longer a setting ({why})")
            node.pop(key)
    moves = []
    for old, new in MOVED.items():
        group, key = old.split(".", 1)
        node = saved.get(group)
        if not (isinstance(node, DictConfig) and key in node):
            continue
        value = node._get_node(key)._value()  # as written (an interpolation stays one)
        node.pop(key)
        if OmegaConf.select(saved, new, default=_ABSENT) is _ABSENT:
            OmegaConf.update(saved, new, value, force_add=True)
        moves.append((old, new))
    if moves:
        warn(moved_warning(str(where), moves))



def load_job(path: str | Path, warn: Callable[[str], None] = _stderr) -> Job:
    """Read a run's saved ``config.yaml`` back into a typed Job (the worker's entry).

    A saved config of an older shape still loads (:func:`migrate_saved`): a retired field is dropped and
    a moved one read at its new place, each with a WARNING through ``warn``, so a run started by an older
    version continues.
    """
    register_configs()
    schema = OmegaConf.structured(Job)
    saved = OmegaConf.load(path)
    if isinstance(saved, DictConfig):
        migrate_saved(saved, str(path), warn)
    return OmegaConf.to_object(OmegaConf.merge(schema, saved))


def job_to_yaml(job: Job) -> str:
    """The resolved composed config, as saved in runs/<name>/config.yaml."""
    plain = dataclasses.asdict(job)
    if "${" in repr(plain):  # a literal ${...} (escaped on the command line): keep it literal
        return OmegaConf.to_yaml(OmegaConf.create(_escape(plain)))
    return OmegaConf.to_yaml(OmegaConf.structured(job), resolve=True)


def literal_dollars(cfg: DictConfig, text: str) -> str:
    """``text`` (``cfg`` resolved, as YAML) with every literal ``${`` escaped again as ``\\${``.

    A value written ``\\${HOME}`` on the command line resolves to the text ``${HOME}`` (for the
    batch script's shell). Saved as it is, reading ``config.yaml`` back would take it for an
    interpolation once more; escaped, it reads back as the same text.
    """
    if "${" not in text:
        return text
    return OmegaConf.to_yaml(OmegaConf.create(_escape(OmegaConf.to_container(cfg, resolve=True))))


def _escape(v):
    if isinstance(v, str):
        return v.replace("${", "\\${")
    if isinstance(v, dict):
        return {k: _escape(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_escape(x) for x in v]
    return v
