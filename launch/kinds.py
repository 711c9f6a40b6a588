"""The one vocabulary of the run's records: the causes of an interruption and the kinds of events.

Both sides read it (the ranks emit event kinds and decide some causes; the report, the plots, the stop rules
and ``status`` read them), so it lives in the contract: torch-free, stdlib only.

* :class:`Cause`: why an attempt ended without finishing the run. The members are in priority order (when the
  evidence of one attempt names several causes, the first wins: a dead node makes NCCL time out on every other
  node, so the node failure, not the timeout, is the cause); each carries its ``colour`` in the plots,
  ``decided`` (the ranks decide it themselves from Slurm's answer at the stop, recovery/stop.py: a ``stop``
  event naming it outranks any guess from logs or sacct), ``final`` (the attempt it ends is not requeued:
  the run waits for its user) and its meaning.
* :class:`EventKind`: the ``event`` of each record of ``events.jsonl`` (recovery/events.py), with the fields
  the kind adds and what it means.

Adding a cause is one member here plus its detector (a log signature in analysis/signatures.py, a sacct state
in analysis/parse_slurm.py, or an event rule in analysis/interruptions.py); tests/test_kinds.py fails while any
consumer does not know it. ``python -m launch.kinds`` prints the documentation tables made from these members
(docs/reports.md and recovery/events.py hold them; a test compares).
"""
from __future__ import annotations

import sys
import textwrap
from enum import StrEnum


class Cause(StrEnum):
    """A cause of an interruption: a ``str`` (``Cause.OOM == "oom"``), with its attributes. Members are in
    priority order, most specific first: adding a cause is one member, at its place."""

    colour: str
    decided: bool
    final: bool
    meaning: str

    def __new__(cls, value: str, colour: str, decided: bool, final: bool, meaning: str):
        obj = str.__new__(cls, value)
        obj._value_ = value
        obj.colour, obj.decided, obj.final, obj.meaning = colour, decided, final, meaning
        return obj

    NODE_FAILURE = ("node_failure", "tab:red", True, False, "a node failed (NODE_FAIL, BOOT_FAIL, srun's node failure)")
    XID = ("xid", "darkred", False, False,
           "a node hardware fault: an NVRM Xid line, or an error launch/hardware_faults.py names (ECC, a GPU off the "
           "bus, a CUDA device fault, NVLink, InfiniBand) in job output or in a rank's exclude event")
    OOM = ("oom", "tab:brown", False, False, "out of memory (CUDA OOM, the kernel OOM killer, sacct OUT_OF_MEMORY)")
    NAN = ("nan", "tab:pink", False, True,
           "a non-finite loss or grad norm (training.nan_guard.on_nan=stop ends the run: exit 11)")
    REPLAY_MISMATCH = ("replay_mismatch", "mediumvioletred", False, True,
                       "the steps replayed after a resume did not reproduce the lost attempt's losses "
                       "(training.replay.on_mismatch=stop: exit 16)")
    BUDGET = ("budget", "darkgoldenrod", False, True,
              "the run's spend reached run.budget_gpu_hours: checkpoint saved, stopped (exit 17)")
    NCCL_TIMEOUT = ("nccl_timeout", "tab:orange", False, False, "a collective timed out (NCCL watchdog)")
    HANG = ("hang", "tab:olive", False, False, "the hang watchdog ended a stuck attempt (a hang event)")
    ZERO_PROGRESS = ("zero_progress", "firebrick", False, True,
                     "the zero-progress guard refused to start: training.zero_progress_restarts consecutive attempts "
                     "made no new checkpoint or failed to start (exit 3)")
    CRASH = ("crash", "tab:red", False, False,
             "an exception in a rank (stop crash, exit error), also one before the first step (startup_failed)")
    PREEMPTION = ("preemption", "tab:purple", True, False,
                  "a preemption (PreemptTime, sacct PREEMPTED, SIGTERM then requeued)")
    TIME_LIMIT = ("time_limit", "tab:blue", True, False,
                  "the job's time limit (the USR2 warning, slurmstepd's DUE TO TIME LIMIT, sacct TIMEOUT/DEADLINE)")
    USER_REQUEUE = ("user_requeue", "tab:cyan", True, False,
                    "scancel --signal=USR2 or an admin's scontrol requeue: checkpoint and requeue")
    USER_STOP = ("user_stop", "tab:green", True, True,
                 "launch/stop.py or scancel --signal=USR1: checkpoint and end, no requeue")
    USER_CANCEL = ("user_cancel", "tab:gray", True, True, "scancel (sacct CANCELLED): no requeue")
    NODE_EXCLUSION = ("node_exclusion", "gold", False, False,
                      "the attempt landed on a recorded failed node and requeued itself away before training "
                      "(an exclude event)")
    UNKNOWN = ("unknown", "black", False, False, "ended, and no evidence says why")

    @property
    def priority(self) -> int:
        """0 is the most specific: it wins over any other evidence of the same attempt (the ranks' own decision
        aside)."""
        return list(type(self)).index(self)

    @classmethod
    def decided_ones(cls) -> tuple["Cause", ...]:
        return tuple(c for c in cls if c.decided)


class EventKind(StrEnum):
    """The ``event`` of a record in ``events.jsonl``: a ``str``, with the fields it adds and its meaning."""

    fields: str

    def __new__(cls, value: str, fields: str):
        obj = str.__new__(cls, value)
        obj._value_ = value
        obj.fields = fields
        return obj

    JOB_START = ("job_start", "world_size, layout {tp,pp,vpp,cp,ep,dp}, layout_label (tp2-pp1-nodo-dp2), train_iters, "
                              "nodes, source (slurm|torchrun), numerics, recipe (what replay parity compares: "
                              "train/replay_parity.py)")
    DATA = ("data", "step, the data sources and their split (train/worker.py) -- what this attempt reads")
    DATA_POSITION = ("data_position", "step, consumed_samples, consumed_per_source -- where each source resumes")
    DATA_CHANGED = ("data_changed", "step, changes -- the data sources differ from the run's previous attempt")
    RESUME = ("resume", "step, checkpoint, consumed_samples, from_layout, seconds (load time)")
    LOCAL_CHECKPOINT_SAVED = ("local_checkpoint_saved", "step, seconds (start to commit), stall_s (training stalled: "
                                                        "the copy), bytes (this rank's shard), nodes, replication, "
                                                        "sent_bytes -- a node-local set committed on every node "
                                                        "(train/local_ckpt.py)")
    LOCAL_CHECKPOINT_SKIPPED = ("local_checkpoint_skipped", "step, path, node, reason, detail -- a local set (or one "
                                                            "node's copy in it) failed verification or is incomplete; "
                                                            "the start passed over it, or it changed between the start's check and its read "
                                                            "(reason changed_after_verification: the global checkpoint is "
                                                            "loaded instead); or a local save failed")
    RESUMED_FROM = ("resumed_from", "tier (global|local|none), step, source, global_step, lost_steps (of the previous "
                                    "attempt's last logged step) -- where this attempt's training state came from")
    RESUME_FALLBACK = ("resume_fallback", "skipped (path), reason, detail -- a torn/corrupt checkpoint was passed "
                                          "over (latest_invalid, latest_target_missing, not_a_directory, no_owner, "
                                          "torn_first_save, ...)")
    QUARANTINE = ("quarantine", "path, to, reason (e.g. unsafe_checkpoint), why, detail -- a checkpoint moved aside")
    SHARED_CHECKPOINT_TRUSTED = ("shared_checkpoint_trusted", "path, reason, detail -- a checkpoint others can write, "
                                                              "loaded because the environment trusts it")
    START_OVER = ("start_over", "reason, detail -- training.restart_from_scratch=true: earlier checkpoints ignored")
    RUN_LOCK_TAKEOVER = ("run_lock_takeover", "holder, reason, detail -- a stale run lock taken over")
    SIGNAL = ("signal", "signal (name), step")
    CHECKPOINT_SAVED = ("checkpoint_saved", "step, path, seconds, bytes, reason (interval|signal|final), mode, "
                                            "blocking_s, written_s")
    CHECKPOINT_ASYNC_STARTED = ("checkpoint_async_started", "step, reason, blocking_s -- an async save began writing")
    CHECKPOINT_WAIT = ("checkpoint_wait", "step, reason, seconds -- training waited for the async save in flight")
    CHECKPOINT_ABANDONED = ("checkpoint_abandoned", "step, phase (write|commit), detail -- an async save in flight "
                                                    "when the attempt failed, or cause writer_stuck, seconds, "
                                                    "limit_s: a write not durable within the save deadline")
    CHECKPOINT_DELAYED = ("checkpoint_delayed", "step, pending_step, detail -- a save waits for the one in flight")
    CHECKPOINT_SEAL_FALLBACK = ("checkpoint_seal_fallback", "step, rank, detail -- a save sealed the slow way")
    CHECKPOINT_WRITER_COLD = ("checkpoint_writer_cold", "detail -- the async writer could not be warmed up")
    CHECKPOINT_INTERVAL = ("checkpoint_interval", "interval, reasoning (Young/Daly), write_s, blocking_s")
    PRUNE_SKIPPED = ("prune_skipped", "step, detail -- old checkpoints were kept (pruning them failed)")
    DISK_SPACE_WARNING = ("disk_space_warning", "step, detail, free/needed bytes -- the next save may not fit")
    LEAD_TIME_WARNING = ("lead_time_warning", "lead_s, step_s, save_s, wait_s, detail -- the signal lead is shorter "
                                              "than a step plus a save")
    REQUEUE = ("requeue", "method (scontrol|exit_code|scontrol_after_crash|slurm), step, signal, job_id_requeued, ok, "
                          "planned (a verified stop checkpoint came first: not counted by training.max_restarts), "
                          "detail, error")
    IN_JOB_RESTART = ("in_job_restart", "cause (crash|hang|lost_node), detail, slurm_restart, next_restart_count, "
                                        "failed_nodes, nodes, master_addr, avoided {host: why}, spare_used, "
                                        "suspects_kept, used, budget, spares_left, phases {detection_s, teardown_s, "
                                        "queue_wait_s, health_check_s} -- a failed step relaunched inside the "
                                        "allocation (recovery/injob.py)")
    FAILED_NODE = ("failed_node", "host, source -- a node a NODE_FAIL (sacct), a hang twice or a hardware fault "
                                  "came from (recovery/exclusion.py)")
    EXCLUDE = ("exclude", "hosts, ok, detail; bad_here (recorded failed nodes in this allocation: it requeues away), "
                          "or reason (a hardware fault of this node: ECC, Xid, NVLink, IB) -- recorded bad nodes kept "
                          "out of the next attempt")
    HANG = ("hang", "deadline, deadline_s, arithmetic, step, suspects, victims, unknown, stacks, dump -- the hang "
                    "watchdog's finding (recovery/watchdog.py)")
    WATCHDOG_UNAVAILABLE = ("watchdog_unavailable", "detail -- the hang watchdog could not start")
    NAN = ("nan", "step, loss, grad_norm, where, policy, first_sample -- a non-finite loss or grad norm")
    NAN_ROLLBACK = ("nan_rollback", "step, to_step, checkpoint, skip_batches, skip_first_sample")
    BATCHES_SKIPPED = ("batches_skipped", "step, batches, samples, first_sample")
    LOSS_SCALE_OVERFLOW = ("loss_scale_overflow", "step, loss_scale")
    STRAGGLER = ("straggler", "step, steps, rank_slow, host_slow, ratio, compute_s, median_s")
    REGRESSION = ("regression", "step, the throughput figures -- steps got slower than the run's own baseline")
    LIVE_CHECKS = ("live_checks", "steps, seconds, median_step_s, overhead, repeated_stragglers")
    VALIDATION = ("validation", "step, loss, iters")
    REPLAY_MATCH = ("replay_match", "mode (bitwise|tolerance), steps, policy, max_rel, detail -- the replayed steps "
                                    "reproduce the log")
    REPLAY_MISMATCH = ("replay_mismatch", "mode, steps, step, diffs [{field, logged, replayed, rel}], policy, detail "
                                          "(recovery/replay.py)")
    REPLAY_ROLLBACK = ("replay_rollback", "step, to_step, from_step, checkpoint -- "
                                          "training.replay.on_mismatch=rollback")
    REPLAY_CHECK_OFF = ("replay_check_off", "step, detail -- the recipe changed since the logging attempt: nothing to "
                                            "compare")
    SAVE_FAILED = ("save_failed", "step, cause (storage_error|disk_full|writer_stuck), save (interval|stop_or_final), "
                                  "policy, in_a_row, go_on, detail -- training.on_save_failure (recovery/savefail.py)")
    CHECKPOINT_COST = ("checkpoint_cost", "step, mode (sync|async), blocked_s, durable_s, step_s_during, "
                                          "step_s_outside, steps_during, dip")
    ITERATION = ("iteration", "step, loss, grad_norm, lr (repr of the float: exact), consumed_samples, seconds, and "
                              "rank 0's memory: mem_allocated, mem_reserved, mem_peak, mem_gap, mem_alloc_retries "
                              "(GPU), mem_rss (CPU) -- every training.log_interval steps, like the log line")
    BUDGET_WARNING = ("budget_warning", "threshold (0.5|0.8|0.95|projected), step, spent, budget, projected, source "
                                        "(sacct|events), unit -- the run's spend passed that fraction of "
                                        "run.budget_gpu_hours (train/budget.py)")
    BUDGET_UNAVAILABLE = ("budget_unavailable", "detail -- the ledger could not be read at the attempt's start (this "
                                                "attempt counts alone)")
    MEMORY_FRAGMENTATION = ("memory_fragmentation", "rank, symptom (gap|alloc_retries), detail, step, first_step, "
                                                    "window, mem_* -- the reserved-allocated gap or the allocator's "
                                                    "retries grew over training.memory_window (train/memory.py)")
    STARTUP_FAILED = ("startup_failed", "attempt, host, error (its first line), phase, record -- a rank failed before "
                      "the start decision (imports, version checks, the process group join); written by that rank")
    STOP = ("stop", "reason, code, detail -- an attempt refused or ended: zero_progress|max_restarts|crash|hang|"
                    "checkpoint_mismatch|unsupported_software|...; or, after a stop checkpoint (recovery/stop.py), "
                    "who stopped it (a decided cause, undecided, local_signal, requeue_signal), with requeue (bool), "
                    "evidence (Slurm's answer), step and saved; budget (step, the ledger in detail); oom (written by "
                    "the rank that ran out: oom_rank, files, mem_*)")
    EXIT = ("exit", "reason (completed|requeue|stopped|signal|error|hang|unsupported_software|...), code, step")
    PREVIOUS_SLICE_TIMEOUT = ("previous_slice_timeout", "job_id_previous, restart_previous, slurm_state, last_step, "
                                                        "resume_step, steps_lost -- the slice before this one ended "
                                                        "TIMEOUT with no stop checkpoint and no exit "
                                                        "(train/previous_slice.py)")
    TRAIN_END = ("train_end", "step, consumed_samples")
    INIT_FROM = ("init_from", "source (a Hugging Face model directory), step 0 -- training.init_from set every weight "
                              "(train/hf_bridge.py)")
    TRACKING_UNAVAILABLE = ("tracking_unavailable", "writer, detail -- a tracking package missing or failing to start "
                                                    "(train/tracking.py)")
    TRACKING_FALLBACK = ("tracking_fallback", "writer, mode, step, detail -- W&B resumed without a rewind, so redone "
                                              "steps may show twice there")


def causes_table() -> str:
    """The Markdown table of the causes (docs/reports.md holds it; tests/test_kinds.py compares)."""
    rows = ["| cause | priority | decided by the ranks | final | meaning |", "|---|---|---|---|---|"]
    rows += [f"| `{c}` | {c.priority} | {'yes' if c.decided else 'no'} | {'yes' if c.final else 'no'} | {c.meaning} |"
             for c in Cause]
    return "\n".join(rows)


def events_table() -> str:
    """The reStructuredText table of the event kinds (recovery/events.py's docstring holds it)."""
    width = max(len(k) for k in EventKind)
    rule = "=" * width + "  " + "=" * 62
    rows = [rule, "event".ljust(width) + "  extra fields", rule]
    for k in EventKind:
        lines = textwrap.wrap(k.fields, 112 - width) or [""]
        rows += [f"{(k.value if i == 0 else '').ljust(width)}  {line}" for i, line in enumerate(lines)]
    return "\n".join(rows + [rule])


def main(argv: list[str]) -> int:
    which = argv[0] if argv else ""
    if which not in ("causes", "events"):
        print("usage: python -m launch.kinds causes|events   (prints the documentation table)", file=sys.stderr)
        return 2
    print(causes_table() if which == "causes" else events_table())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
