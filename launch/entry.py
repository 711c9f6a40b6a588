"""The Hydra glue shared by the login entry points (``pretrain.py``, ``plan.py``, ``preflight.py``).

Each entry point is a thin ``main(cfg) -> int`` that tests call with a composed config; when run
as a script it ends with ``sys.exit(hydra_entry(...))``. This module does what every one of them
needs around ``@hydra.main``: register the schema, add the quiet defaults (no ``outputs/`` or
``multirun/`` folders, no log files; a sweep keeps Hydra's ``multirun.yaml`` beside its registry),
and hand the exit status of ``main`` back (``@hydra.main`` itself returns nothing).

Login-node code: Hydra and the schema only, no torch.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Callable

from omegaconf import DictConfig

from launch.compose import CONFIG_DIR
from launch.config import register_configs

CONFIG_NAME = "config"


def new_sweep_id(clock: Callable[[], float] = time.time) -> str:
    """One id per invocation: a multirun's members share it (their registry is ``<run_root>/sweeps/<id>.jsonl``)."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime(clock())) + f"-{os.getpid()}"


def quiet_hydra_overrides(argv: list[str], sweep_id: str, scratch_dir: str = "") -> list[str]:
    """Hydra defaults for a login-node tool: no outputs/ or multirun/ folders, no log files.

    The run directory is the record of a run; Hydra's own output folders would only litter
    the working directory (and be written even when the job is refused). A multirun keeps
    Hydra's ``multirun.yaml`` beside its registry, in ``<run_root>/sweeps/<sweep id>/``; a dry
    run writes nothing, so its record goes to ``scratch_dir`` (removed afterwards).
    A user override of the same key wins (it is not added).
    """
    dry = any(a.lstrip("+") in ("dry_run=true", "dry_run=True", "dry_run=1") for a in argv)
    sweep_dir = (scratch_dir or "${cluster.run_root}/sweeps/" + sweep_id) if dry else \
        "${cluster.run_root}/sweeps/" + sweep_id
    wanted = {"hydra.output_subdir": "null", "hydra.run.dir": ".",
              "hydra.sweep.dir": sweep_dir, "hydra.sweep.subdir": ".",
              "hydra/job_logging": "disabled", "hydra/hydra_logging": "disabled"}
    given = {a.split("=", 1)[0].lstrip("+~") for a in argv if "=" in a}
    return [f"{k}={v}" for k, v in wanted.items() if k not in given]


def hydra_entry(main: Callable[[DictConfig, str], int], sweep_id: str = "") -> int:
    """Run ``main(cfg, sweep_id)`` under ``@hydra.main`` with the quiet defaults; its exit status.

    Hydra reads ``sys.argv`` itself, so the quiet overrides are inserted there, before the first
    user override (argparse wants the positional overrides in one run). A multirun gets a scratch
    directory for Hydra's record of a dry run, removed when Hydra returns.
    """
    import shutil
    import tempfile

    import hydra

    argv = sys.argv
    register_configs()
    sweep_id = sweep_id or new_sweep_id()
    at = next((i for i, a in enumerate(argv) if i and "=" in a and not a.startswith("-")), len(argv))
    multirun = any(a in ("-m", "--multirun") for a in argv[1:])
    scratch = tempfile.mkdtemp(prefix="slurmtron-dry-sweep-") if multirun else ""
    argv[at:at] = quiet_hydra_overrides(argv[1:], sweep_id, scratch)
    rc = [0]

    @hydra.main(config_path=str(CONFIG_DIR), config_name=CONFIG_NAME, version_base="1.3")
    def _entry(cfg: DictConfig) -> None:
        rc[0] = int(main(cfg, sweep_id))

    try:
        _entry()
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    return rc[0]
