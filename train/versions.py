"""Which torch and Megatron-Core a rank runs with, checked before anything imports them.

The ``[train]`` extra of ``pyproject.toml`` states the tested ranges as pip requirements,
but a rank often runs in an environment pip never resolved: a container image with its own
torch (installed with ``--no-deps``), environment modules, a site venv. So every rank checks
again at start (:func:`refuse_unsupported`, the first call in ``train.worker.main``) and,
outside the ranges, stops with one line naming what it found and what is supported, exit
code :data:`recovery.policy.EXIT_UNSUPPORTED`, and ``stop``/``exit`` events that the
crash-requeue path (:mod:`recovery.crash`) treats as final: another attempt on the same
software would fail the same way.

``training.precision=fp8`` is refused the same way: without TransformerEngine (Megatron-Core's
fp8 path lives in TE's layers) it cannot run, and with TE the translator has no fp8 recipe yet
(it would otherwise crash in :func:`train.megatron_model.params_dtype` and be requeued). It is
never downgraded to bf16. ``parallelism.tp_comm_overlap`` without TransformerEngine too: the
overlap lives in TE's userbuffers.

Pre-releases and local builds count as their release number: NGC images ship torch as
``2.x.0a0+<git hash>``, which is that release's code, and PEP 440 would otherwise order it
before ``2.x.0``.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from typing import Callable, Mapping, Optional

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from launch.kinds import EventKind
from launch.paths import RunPaths
from recovery.events import EventLog
from launch.attempts import ATTEMPT_ENV
from recovery.policy import EXIT_UNSUPPORTED, attempt_from_env, restart_count_from_env

# distribution name -> tested range; pyproject.toml's [train] extra says the same (a test checks)
SUPPORTED = {
    "torch": ">=2.11,<2.14",
    "megatron-core": ">=0.16.1,<0.17",
}
MODULES = {"torch": "torch", "megatron-core": "megatron.core"}  # what the rank imports


def _metadata_version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _module_version(module: str) -> Optional[str]:
    """``__version__`` of an importable module without installed metadata (a source checkout on
    ``PYTHONPATH``, as some images carry Megatron-LM)."""
    try:
        mod = importlib.import_module(module)
    except Exception:  # noqa: BLE001 - a broken install is reported as not importable
        return None
    return getattr(mod, "__version__", None) or getattr(getattr(mod, "package_info", None), "__version__", None)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def in_range(version: str, spec: str) -> bool:
    """``version`` (its release number) within the specifier set ``spec``."""
    try:
        release = Version(version).release
    except InvalidVersion:
        return False
    return SpecifierSet(spec).contains(Version(".".join(map(str, release))), prereleases=True)


def problems(
    *,
    version_of: Callable[[str], Optional[str]] = _metadata_version,
    importable: Callable[[str], bool] = _importable,
    module_version: Callable[[str], Optional[str]] = _module_version,
) -> tuple[list[str], dict]:
    """(what is wrong, {distribution: version found or None}) for :data:`SUPPORTED`."""
    found: dict = {}
    wrong: list[str] = []
    for dist, spec in SUPPORTED.items():
        module = MODULES[dist]
        if not importable(module):
            found[dist] = None
            wrong.append(f"{dist} is not importable (import {module})")
            continue
        version = version_of(dist) or module_version(module)
        found[dist] = version
        if version is None:
            wrong.append(f"{dist} has no version (no package metadata, no {module}.__version__)")
        elif not in_range(version, spec):
            wrong.append(f"{dist} {version} is outside {spec}")
    return wrong, found


def have_transformer_engine() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - ImportError, or a broken install raising at import
        return False
    return True


def refusal(precision: str = "", tp_comm_overlap: bool = False, **probes: Callable) -> Optional[str]:
    """The one-line refusal, or None when this rank's software can run the job."""
    have_te = probes.pop("have_te", have_transformer_engine)
    wrong, found = problems(**probes)
    seen = ", ".join(f"{d} {found.get(d) or 'missing'}" for d in SUPPORTED)
    if wrong:
        wanted = ", ".join(f"{d}{s}" for d, s in SUPPORTED.items())
        return (f"slurmtron: refusing to start: {'; '.join(wrong)} (found {seen}; supported {wanted}; "
                f"fix: install the [train] extra's versions, e.g. pip install --no-deps 'megatron-core"
                f"{SUPPORTED['megatron-core']}' inside a container whose torch is in range)")
    if precision == "fp8" and not have_te():
        return (f"slurmtron: refusing to start: training.precision=fp8 needs TransformerEngine, which is "
                f"not importable here (found {seen}); fix: training.precision=bf16, or an image with "
                f"TransformerEngine")
    if tp_comm_overlap and not have_te():
        return (f"slurmtron: refusing to start: parallelism.tp_comm_overlap=true needs TransformerEngine's "
                f"userbuffers, which are not importable here (found {seen}); fix: parallelism.tp_comm_overlap=false, "
                f"or an image with TransformerEngine")
    if precision == "fp8":  # TE is there, but the translator has no fp8 recipe (never run on hardware)
        return (f"slurmtron: refusing to start: training.precision=fp8 is not supported by this worker yet "
                f"(TransformerEngine is importable; found {seen}); fix: training.precision=bf16")
    return None


def _rank(env: Mapping[str, str]) -> int:
    """This rank's number without resolving any host (Slurm's, torchrun's, else 0)."""
    raw = env.get("RANK") if "RANK" in env else env.get("SLURM_PROCID")
    try:
        return int(raw or 0)
    except ValueError:
        return 0


def refuse_unsupported(run_dir: Path, env: Mapping[str, str], precision: str = "", *, tp_comm_overlap: bool = False,
                       out=None, **probes: Callable) -> Optional[int]:
    """None to go on; else print the refusal, record it (rank 0) and return the exit code."""
    line = refusal(precision, tp_comm_overlap, **probes)
    if line is None:
        return None

    print(line, file=out or sys.stderr, flush=True)
    rank = _rank(env)
    try:
        restart = restart_count_from_env(env)
    except ValueError:
        restart = 0
    try:  # the attempt's number in the run where the local launcher numbered it (launch/attempts.py)
        attempt = attempt_from_env(env) if env.get(ATTEMPT_ENV) not in (None, "") else None
    except ValueError:
        attempt = None
    events = EventLog(RunPaths.of(run_dir).events, rank=rank, job_id=env.get("SLURM_JOB_ID"),
                      restart_count=restart, enabled=rank == 0, attempt=attempt)
    events.emit(EventKind.STOP, reason="unsupported_software", code=EXIT_UNSUPPORTED, detail=line)
    events.emit(EventKind.EXIT, reason="unsupported_software", code=EXIT_UNSUPPORTED, step=None)
    return EXIT_UNSUPPORTED
