"""The exit codes of ``python -m train.worker``, defined once: name, code, final or not, meaning.

The ranks exit with them, the local launcher relaunches (or not) on them, the batch script's
rendering fills them into ``sbatch_templates/srun.sh``, ``recovery.crash`` judges srun's code by them,
and the table in ``docs/recovery.md`` is :func:`markdown_table` of :data:`EXIT_CODES` (a test compares
the two). A *final* code is a refusal or an end: another attempt would meet the same, so nothing
(the ranks, ``recovery.crash``, the local launcher) starts one after it.

Standard library only: the login node, the batch script's helpers and the ranks all import it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExitCode:
    """One exit code: ``name`` (the Python constant), ``code``, whether it is ``final`` (never requeued or
    relaunched), the stop ``reason`` a final refusal is recorded under in ``events.jsonl`` ('' for none),
    and what it means."""

    name: str
    code: int
    final: bool
    reason: str
    meaning: str


EXIT_CODES: tuple[ExitCode, ...] = (
    ExitCode("EXIT_COMPLETED", 0, True, "",
             "reached train_iters (final checkpoint committed), or the run was stopped or is already complete"),
    ExitCode("EXIT_CRASH", 1, False, "",
             "an exception; `recovery.crash` (Slurm) or the local launcher starts another attempt, bounded by the "
             "zero-progress guard and `training.max_restarts`"),
    ExitCode("EXIT_ZERO_PROGRESS", 3, True, "zero_progress",
             "refused to start: `training.zero_progress_restarts` consecutive restarts made no new checkpoint, or "
             "failed before their first step (an import, the process group join: `startup/`)"),
    ExitCode("EXIT_MAX_RESTARTS", 4, True, "max_restarts",
             "refused to start: more unplanned restarts (crashes, hangs, node failures) than `training.max_restarts`; "
             "planned slice requeues are not counted"),
    ExitCode("EXIT_NO_LOADABLE", 5, True, "no_loadable_checkpoint",
             "refused to start: checkpoints exist and none verifies (none is overwritten; "
             "`training.restart_from_scratch=true` quarantines them)"),
    ExitCode("EXIT_FOREIGN", 6, True, "foreign_checkpoint",
             "refused to start: the newest checkpoint belongs to another run"),
    ExitCode("EXIT_STORAGE", 7, True, "storage_error",
             "stopped: a checkpoint (or the run directory) cannot be read or written (EACCES, EIO, ESTALE, a missing "
             "mount): an environment error, nothing skipped"),
    ExitCode("EXIT_DISK_FULL", 8, True, "disk_full",
             "stopped: ENOSPC/EDQUOT during a save; the staging directory was removed, committed checkpoints kept"),
    ExitCode("EXIT_RUN_LOCKED", 9, True, "run_locked",
             "refused to start: another live attempt holds the run lock"),
    ExitCode("EXIT_UNSUPPORTED", 10, True, "unsupported_software",
             "refused to start: torch/megatron-core outside the tested ranges, or fp8 / `tp_comm_overlap` without "
             "TransformerEngine (`train/versions.py`)"),
    ExitCode("EXIT_NAN", 11, True, "nan",
             "a non-finite loss or grad norm with `training.nan_guard.on_nan=stop` (or rollbacks exhausted); "
             "nothing non-finite was applied or saved"),
    ExitCode("EXIT_UNSAFE_CKPT", 12, True, "unsafe_checkpoint",
             "refused to start: the checkpoint to resume from holds a pickle that needs more than checkpoint data "
             "types (code could run on load); it was moved to `quarantine/` (`recovery/pickle_guard.py`)"),
    ExitCode("EXIT_SHARED_CKPT", 13, True, "shared_checkpoint",
             "refused to start: the checkpoint to resume from is writable by other users (group/world-writable, or "
             "owned by another uid); `SLURMTRON_TRUST_SHARED_CHECKPOINTS=1` accepts it"),
    ExitCode("EXIT_BAD_CONFIG", 14, True, "bad_config",
             "refused to start: the run's `config.yaml` cannot be read back into a job (missing, binary, malformed "
             "YAML, a field of the wrong type)"),
    ExitCode("EXIT_CKPT_MISMATCH", 15, True, "checkpoint_mismatch",
             "refused to start: the run's checkpoint cannot be loaded by this job's configuration (the other "
             "optimizer type: `parallelism.distributed_optimizer` changed; `recovery/start_check.py`)"),
    ExitCode("EXIT_REPLAY_MISMATCH", 16, True, "replay_mismatch",
             "stopped: the steps replayed after a resume do not reproduce the losses the lost attempt logged "
             "(`recovery/replay.py`, `training.replay.on_mismatch=stop`, the default when bitwise was expected); "
             "nothing deleted: the checkpoint is where it was"),
    ExitCode("EXIT_BUDGET", 17, True, "budget",
             "stopped: the run's spend reached `run.budget_gpu_hours`; a verified checkpoint was saved; raise the "
             "budget and resubmit (`train/budget.py`)"),
    ExitCode("EXIT_OOM", 18, True, "oom",
             "stopped: out of GPU memory; the memory summary is under the run directory's `oom/` (`train/memory.py`): "
             "a deterministic OOM does not fix itself on a requeue"),
    ExitCode("EXIT_REQUEUE", 42, False, "",
             "stop signal, checkpoint committed, requeue asked of Slurm (the local launcher relaunches)"),
)

BY_NAME = {e.name: e for e in EXIT_CODES}
BY_CODE = {e.code: e for e in EXIT_CODES}

EXIT_COMPLETED = BY_NAME["EXIT_COMPLETED"].code
EXIT_CRASH = BY_NAME["EXIT_CRASH"].code
EXIT_ZERO_PROGRESS = BY_NAME["EXIT_ZERO_PROGRESS"].code
EXIT_MAX_RESTARTS = BY_NAME["EXIT_MAX_RESTARTS"].code
EXIT_NO_LOADABLE = BY_NAME["EXIT_NO_LOADABLE"].code
EXIT_FOREIGN = BY_NAME["EXIT_FOREIGN"].code
EXIT_STORAGE = BY_NAME["EXIT_STORAGE"].code
EXIT_DISK_FULL = BY_NAME["EXIT_DISK_FULL"].code
EXIT_RUN_LOCKED = BY_NAME["EXIT_RUN_LOCKED"].code
EXIT_UNSUPPORTED = BY_NAME["EXIT_UNSUPPORTED"].code
EXIT_NAN = BY_NAME["EXIT_NAN"].code
EXIT_UNSAFE_CKPT = BY_NAME["EXIT_UNSAFE_CKPT"].code
EXIT_SHARED_CKPT = BY_NAME["EXIT_SHARED_CKPT"].code
EXIT_BAD_CONFIG = BY_NAME["EXIT_BAD_CONFIG"].code
EXIT_CKPT_MISMATCH = BY_NAME["EXIT_CKPT_MISMATCH"].code
EXIT_REPLAY_MISMATCH = BY_NAME["EXIT_REPLAY_MISMATCH"].code
EXIT_BUDGET = BY_NAME["EXIT_BUDGET"].code
EXIT_OOM = BY_NAME["EXIT_OOM"].code
EXIT_REQUEUE = BY_NAME["EXIT_REQUEUE"].code

# stop reason -> exit code, for every final refusal (no requeue, no relaunch)
FINAL_REASONS = {e.reason: e.code for e in EXIT_CODES if e.final and e.reason}
REFUSAL_CODES = tuple(sorted(FINAL_REASONS.values()))  # "do not retry": never requeued or relaunched
FINAL_CODES = tuple(sorted(e.code for e in EXIT_CODES if e.final))  # nothing starts another attempt after these


def code_name(code: int) -> str:
    """The reason a final exit code stands for (``run_locked`` for :data:`EXIT_RUN_LOCKED`), or ``exit <code>``."""
    entry = BY_CODE.get(code)
    return entry.reason if entry is not None and entry.reason else f"exit {code}"


def markdown_table() -> str:
    """The table of ``docs/recovery.md`` (code, name, final, stop reason, meaning), one row per exit code."""
    rows = ["| code | name | final | stop reason | meaning |", "|---|---|---|---|---|"]
    for e in EXIT_CODES:
        rows.append(f"| {e.code} | `{e.name}` | {'yes' if e.final else 'no'} | "
                    f"{f'`{e.reason}`' if e.reason else ''} | {e.meaning} |")
    return "\n".join(rows)


def shell_values() -> dict[str, str]:
    """The codes the batch script tests and names, as ``sbatch_templates/`` placeholders (``{{exit_requeue}}``)."""
    return {"exit_requeue": str(EXIT_REQUEUE),
            "refusal_codes": ", ".join(f"{BY_CODE[c].reason} {c}" for c in REFUSAL_CODES)}
