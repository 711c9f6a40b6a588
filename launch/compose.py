"""Compose a typed :class:`~launch.config.Job` from overrides, outside ``@hydra.main``.

Tests, ``plan.py`` and the worker use this; ``pretrain.py`` gets the same object from
``@hydra.main`` and :func:`to_job`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from launch.config import Job, register_configs

CONFIG_DIR = Path(__file__).resolve().parent.parent / "hydra_conf"


def to_job(cfg: DictConfig) -> Job:
    """Turn a composed DictConfig into the typed Job (runs each dataclass' __post_init__)."""
    job = OmegaConf.to_object(cfg)
    if not isinstance(job, Job):
        raise TypeError(f"composed config is a {type(job).__name__}, expected Job (is base_job first in defaults?)")
    return job


def compose_job(overrides: Sequence[str] = (), config_name: str = "config") -> Job:
    """Compose hydra_conf/<config_name>.yaml with ``overrides`` and return the typed Job."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=list(overrides))
    return to_job(cfg)


def load_job(path: str | Path) -> Job:
    """Read a run's saved ``config.yaml`` back into a typed Job (the worker's entry)."""
    register_configs()
    schema = OmegaConf.structured(Job)
    return OmegaConf.to_object(OmegaConf.merge(schema, OmegaConf.load(path)))


def job_to_yaml(job: Job) -> str:
    """The resolved composed config, as saved in runs/<name>/config.yaml."""
    return OmegaConf.to_yaml(OmegaConf.structured(job), resolve=True)
