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

from launch.cli import EXIT_REFUSED, override_error_line, wants_help
from launch.compose import CONFIG_DIR, migrate_overrides
from launch.config import register_configs
from launch.paths import run_root_problem

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


def run_root_override_problem(argv: list[str]) -> str:
    """The run-directory rule's line for a ``cluster.run_root=`` override that is empty or the filesystem root
    ('' when there is none): Hydra would create a multirun's ``<run_root>/sweeps/<id>/`` there before any check."""
    for a in argv:
        key, sep, value = a.lstrip("+~").partition("=")
        if sep and key == "cluster.run_root" and not value.strip().strip("'\"").strip():
            return run_root_problem("") or ""
        if sep and key == "cluster.run_root" and value.strip().strip("'\"").rstrip("/") == "":
            return run_root_problem("/") or ""
    return ""


def hydra_entry(main: Callable[[DictConfig, str], int], sweep_id: str = "", usage: str = "") -> int:
    """Run ``main(cfg, sweep_id)`` under ``@hydra.main`` with the quiet defaults; its exit status.

    Hydra reads ``sys.argv`` itself, so the quiet overrides are inserted there, before the first
    user override (argparse wants the positional overrides in one run). A multirun gets a scratch
    directory for Hydra's record of a dry run, removed when Hydra returns.

    ``-h``/``--help`` prints ``usage`` (the entry point's short help) and returns 0;
    ``--help-config`` is Hydra's own help (the config groups, their choices, the composed config).
    An override Hydra cannot parse or apply (a typo, an unknown choice, a bad value) is one line
    (:func:`launch.cli.override_error_line`) and exit 2, not Hydra's several lines and exit 1.
    """
    import shutil
    import tempfile

    import hydra

    argv = sys.argv
    if usage and wants_help(argv[1:]):
        print(usage)
        return 0
    argv[1:] = ["--help" if a == "--help-config" else a for a in argv[1:]]
    problem = run_root_override_problem(argv[1:])
    if problem:  # before Hydra: a multirun creates its sweep directory under the run root before any check
        print(f"refused: {problem}; nothing was written", file=sys.stderr)
        return EXIT_REFUSED
    argv[1:] = migrate_overrides(argv[1:])  # an old key (training.hang_step_floor_s) at its new place, a WARNING
    register_configs()
    sweep_id = sweep_id or new_sweep_id()
    at = next((i for i, a in enumerate(argv) if i and "=" in a and not a.startswith("-")), len(argv))
    multirun = any(a in ("-m", "--multirun") for a in argv[1:])
    scratch = tempfile.mkdtemp(prefix="slurmtron-dry-sweep-") if multirun else ""
    argv[at:at] = quiet_hydra_overrides(argv[1:], sweep_id, scratch)
    rc = [0]
    in_task = [False]
    user_overrides = list(argv[1:])
    full_error = os.environ.get(FULL_ERROR)

    @hydra.main(config_path=str(CONFIG_DIR), config_name=CONFIG_NAME, version_base="1.3")
    def _entry(cfg: DictConfig) -> None:
        in_task[0] = True
        _set_env(FULL_ERROR, full_error)  # the entry point (and what it spawns) sees the user's setting
        try:
            rc[0] = int(main(cfg, sweep_id))
        finally:
            os.environ[FULL_ERROR] = "1"
        in_task[0] = False

    # Hydra prints its own errors (several lines, exit 1) unless HYDRA_FULL_ERROR is set: then it
    # raises them, and an error of the overrides becomes one refusal line here.
    os.environ[FULL_ERROR] = "1"
    try:
        _entry()
    except Exception as exc:
        if in_task[0] or full_error == "1":  # the entry point's own failure, or asked for Hydra's full error
            raise
        print(override_error_line(exc, user_overrides), file=sys.stderr)
        return EXIT_REFUSED
    finally:
        _set_env(FULL_ERROR, full_error)
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    return rc[0]


FULL_ERROR = "HYDRA_FULL_ERROR"


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
