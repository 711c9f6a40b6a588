"""The run's machine-readable event log: ``<run_dir>/events.jsonl``.

One JSON object per line, appended and flushed (and fsynced) per event, so a killed job
leaves every event it emitted. The analysis reports join this with ``sacct`` records.

Every record has ``time`` (unix seconds, float), ``event`` (a kind below), ``job_id``
(``SLURM_JOB_ID`` or null), ``restart_count``, ``rank`` and ``host`` (and ``attempt``, the attempt's number in the
run, where the local launcher numbered it: :mod:`launch.attempts`); each kind adds fields:

=========================  ==============================================================
event                      extra fields
=========================  ==============================================================
job_start                  world_size, layout {tp,pp,vpp,cp,ep,dp}, layout_label (tp2-pp1-nodo-dp2), train_iters,
                           nodes, source (slurm|torchrun), numerics, recipe (what replay parity compares:
                           train/replay_parity.py)
data                       step, the data sources and their split (train/worker.py) -- what this attempt reads
data_position              step, consumed_samples, consumed_per_source -- where each source resumes
data_changed               step, changes -- the data sources differ from the run's previous attempt
resume                     step, checkpoint, consumed_samples, from_layout, seconds (load time)
local_checkpoint_saved     step, seconds (start to commit), stall_s (training stalled: the copy), bytes (this
                           rank's shard), nodes, replication, sent_bytes -- a node-local set committed on every
                           node (train/local_ckpt.py)
local_checkpoint_skipped   step, path, node, reason, detail -- a local set (or one node's copy in it) failed
                           verification or is incomplete; the start passed over it, or it changed between the
                           start's check and its read (reason changed_after_verification: the global checkpoint is
                           loaded instead); or a local save failed
resumed_from               tier (global|local|none), step, source, global_step, lost_steps (of the previous
                           attempt's last logged step) -- where this attempt's training state came from
resume_fallback            skipped (path), reason, detail -- a torn/corrupt checkpoint was passed over
                           (latest_invalid, latest_target_missing, not_a_directory, no_owner, torn_first_save,
                           ...)
quarantine                 path, to, reason (e.g. unsafe_checkpoint), why, detail -- a checkpoint moved aside
shared_checkpoint_trusted  path, reason, detail -- a checkpoint others can write, loaded because the environment
                           trusts it
start_over                 reason, detail -- training.restart_from_scratch=true: earlier checkpoints ignored
run_lock_takeover          holder, reason, detail -- a stale run lock taken over
signal                     signal (name), step
checkpoint_saved           step, path, seconds, bytes, reason (interval|signal|final), mode, blocking_s, written_s
checkpoint_async_started   step, reason, blocking_s -- an async save began writing
checkpoint_wait            step, reason, seconds -- training waited for the async save in flight
checkpoint_abandoned       step, phase (write|commit), detail -- an async save in flight when the attempt failed,
                           or cause writer_stuck, seconds, limit_s: a write not durable within the save deadline
checkpoint_delayed         step, pending_step, detail -- a save waits for the one in flight
checkpoint_seal_fallback   step, rank, detail -- a save sealed the slow way
checkpoint_writer_cold     detail -- the async writer could not be warmed up
checkpoint_interval        interval, reasoning (Young/Daly), write_s, blocking_s
prune_skipped              step, detail -- old checkpoints were kept (pruning them failed)
disk_space_warning         step, detail, free/needed bytes -- the next save may not fit
lead_time_warning          lead_s, step_s, save_s, wait_s, detail -- the signal lead is shorter than a step plus a
                           save
requeue                    method (scontrol|exit_code|scontrol_after_crash|slurm), step, signal, job_id_requeued,
                           ok, planned (a verified stop checkpoint came first: not counted by
                           training.max_restarts), detail, error
in_job_restart             cause (crash|hang|lost_node), detail, slurm_restart, next_restart_count, failed_nodes,
                           nodes, master_addr, avoided {host: why}, spare_used, suspects_kept, used, budget,
                           spares_left, phases {detection_s, teardown_s, queue_wait_s, health_check_s} -- a failed
                           step relaunched inside the allocation (recovery/injob.py)
failed_node                host, source -- a node a NODE_FAIL (sacct), a hang twice or a hardware fault came from
                           (recovery/exclusion.py)
exclude                    hosts, ok, detail; bad_here (recorded failed nodes in this allocation: it requeues
                           away), or reason (a hardware fault of this node: ECC, Xid, NVLink, IB) -- recorded bad
                           nodes kept out of the next attempt
hang                       deadline, deadline_s, arithmetic, step, suspects, victims, unknown, stacks, dump -- the
                           hang watchdog's finding (recovery/watchdog.py)
watchdog_unavailable       detail -- the hang watchdog could not start
nan                        step, loss, grad_norm, where, policy, first_sample -- a non-finite loss or grad norm
nan_rollback               step, to_step, checkpoint, skip_batches, skip_first_sample
batches_skipped            step, batches, samples, first_sample
loss_scale_overflow        step, loss_scale
straggler                  step, steps, rank_slow, host_slow, ratio, compute_s, median_s
regression                 step, the throughput figures -- steps got slower than the run's own baseline
live_checks                steps, seconds, median_step_s, overhead, repeated_stragglers
validation                 step, loss, iters
replay_match               mode (bitwise|tolerance), steps, policy, max_rel, detail -- the replayed steps
                           reproduce the log
replay_mismatch            mode, steps, step, diffs [{field, logged, replayed, rel}], policy, detail
                           (recovery/replay.py)
replay_rollback            step, to_step, from_step, checkpoint -- training.replay.on_mismatch=rollback
replay_check_off           step, detail -- the recipe changed since the logging attempt: nothing to compare
save_failed                step, cause (storage_error|disk_full|writer_stuck), save (interval|stop_or_final),
                           policy, in_a_row, go_on, detail -- training.on_save_failure (recovery/savefail.py)
checkpoint_cost            step, mode (sync|async), blocked_s, durable_s, step_s_during, step_s_outside,
                           steps_during, dip
iteration                  step, loss, grad_norm, lr (repr of the float: exact), consumed_samples, seconds, and
                           rank 0's memory: mem_allocated, mem_reserved, mem_peak, mem_gap, mem_alloc_retries
                           (GPU), mem_rss (CPU) -- every training.log_interval steps, like the log line
budget_warning             threshold (0.5|0.8|0.95|projected), step, spent, budget, projected, source
                           (sacct|events), unit -- the run's spend passed that fraction of run.budget_gpu_hours
                           (train/budget.py)
budget_unavailable         detail -- the ledger could not be read at the attempt's start (this attempt counts
                           alone)
memory_fragmentation       rank, symptom (gap|alloc_retries), detail, step, first_step, window, mem_* -- the
                           reserved-allocated gap or the allocator's retries grew over training.memory_window
                           (train/memory.py)
startup_failed             attempt, host, error (its first line), phase, record -- a rank failed before the start
                           decision (imports, version checks, the process group join); written by that rank
stop                       reason, code, detail -- an attempt refused or ended:
                           zero_progress|max_restarts|crash|hang|checkpoint_mismatch|unsupported_software|...; or,
                           after a stop checkpoint (recovery/stop.py), who stopped it (a decided cause, undecided,
                           local_signal, requeue_signal), with requeue (bool), evidence (Slurm's answer), step and
                           saved; budget (step, the ledger in detail); oom (written by the rank that ran out:
                           oom_rank, files, mem_*)
exit                       reason (completed|requeue|stopped|signal|error|hang|unsupported_software|...), code,
                           step
previous_slice_timeout     job_id_previous, restart_previous, slurm_state, last_step, resume_step, steps_lost --
                           the slice before this one ended TIMEOUT with no stop checkpoint and no exit
                           (train/previous_slice.py)
train_end                  step, consumed_samples
init_from                  source (a Hugging Face model directory), step 0 -- training.init_from set every weight
                           (train/hf_bridge.py)
tracking_unavailable       writer, detail -- a tracking package missing or failing to start (train/tracking.py)
tracking_fallback          writer, mode, step, detail -- W&B resumed without a rewind, so redone steps may show
                           twice there
=========================  ==============================================================

The kinds are :class:`launch.kinds.EventKind`: every emitter names one of them (never a string literal), and this
table is the output of ``python -m launch.kinds events`` (tests/test_kinds.py compares).
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Optional

from launch.kinds import EventKind


class EventLog:
    """Append-only JSON-lines writer; clock and identity are injected for tests."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        rank: int = 0,
        job_id: Optional[str] = None,
        restart_count: int = 0,
        clock: Callable[[], float] = time.time,
        host: Optional[str] = None,
        enabled: bool = True,
        attempt: Optional[int] = None,
    ) -> None:
        self.path = Path(path)
        self.attempt = attempt  # the attempt's number in the run where it is not the restart count (launch/attempts.py)
        self.rank = rank
        self.job_id = job_id
        self.restart_count = restart_count
        self.clock = clock
        self.host = host or socket.gethostname()
        self.enabled = enabled

    def emit(self, event: EventKind, **fields: Any) -> dict:
        record = {
            "time": self.clock(),
            "event": str(event),
            "job_id": self.job_id,
            "restart_count": self.restart_count,
            **({"attempt": self.attempt} if self.attempt is not None else {}),
            "rank": self.rank,
            "host": self.host,
            **fields,
        }
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            append_line(self.path, json.dumps(record, default=str))
        return record


def append_line(path: Path, line: str) -> None:
    """Append ``line`` and a newline, fsynced. A last line left without its newline (a writer killed mid-line)
    is closed first, so the new record starts on a line of its own instead of being swallowed by the torn one
    (which readers skip and count)."""
    with open(path, "ab+") as f:
        f.seek(0, os.SEEK_END)
        torn = False
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"
        f.write((("\n" if torn else "") + line + "\n").encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())


def parse_json_lines_counted(text: str) -> tuple[list[dict], int]:
    """(the JSON objects of ``text``, one a line; how many non-blank lines were not one: torn or garbage)."""
    out, torn = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            torn += 1
            continue
        if isinstance(rec, dict):
            out.append(rec)
        else:
            torn += 1
    return out, torn


def parse_json_lines(text: str) -> list[dict]:
    """The JSON objects of ``text``, one a line; other lines (a torn last line) are skipped."""
    return parse_json_lines_counted(text)[0]


def read_events_counted(path: str | os.PathLike) -> tuple[list[dict], int]:
    """(the records of an event log, the number of torn or unreadable lines skipped); a missing file is empty."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8", errors="replace")
    except (FileNotFoundError, NotADirectoryError):
        return [], 0
    except IsADirectoryError:
        return [], 1
    return parse_json_lines_counted(text)


def read_events(path: str | os.PathLike) -> list[dict]:
    """Read an event log (or any JSON-lines record file), skipping torn lines (:func:`read_events_counted`
    counts them)."""
    return read_events_counted(path)[0]


def torn_warning(path: str | os.PathLike, torn: int) -> Optional[str]:
    """The WARNING line for ``torn`` skipped lines of ``path``, or None."""
    if not torn:
        return None
    return (f"WARNING: {path}: {torn} torn or unreadable line(s) skipped (a writer killed mid-line, or not JSON); "
            f"the other records are read")
