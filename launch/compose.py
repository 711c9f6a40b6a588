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


def compose_job(overrides: Sequence[str] = (), config_name: str = "config") -> Job:
    """Compose hydra_conf/<config_name>.yaml with ``overrides`` and return the typed Job."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=list(overrides))
    return to_job(cfg)


# Fields that left the schema, and where they went: a config.yaml saved before still loads.
RETIRED = {
    ("training", "fail_at_iter"): "a test hook, now the environment switch SLURMTRON_TEST_FAIL_AT_ITER",
}


def load_job(path: str | Path, warn: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr)) -> Job:
    """Read a run's saved ``config.yaml`` back into a typed Job (the worker's entry).

    A retired field (:data:`RETIRED`) is dropped with a WARNING through ``warn``, so a run
    started by an older version continues.
    """
    register_configs()
    schema = OmegaConf.structured(Job)
    saved = OmegaConf.load(path)
    for (group, key), where in RETIRED.items():
        node = saved.get(group) if isinstance(saved, DictConfig) else None
        if isinstance(node, DictConfig) and key in node:
            warn(f"WARNING: {path}: ignoring {group}.{key}={node[key]!r}, no longer a setting ({where})")
            node.pop(key)
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
