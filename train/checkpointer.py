"""The rank's checkpointing: where to resume from, and when and how to save.

:func:`find_start` (rank 0 searches and decides, every rank follows) runs before the model
exists; :class:`Checkpointer` owns everything after it: loading the resume point, the
collective save (stage, write shards, commit on rank 0), the steps already durable, the
checkpoint interval (a step count, or ``auto`` resolved from the first measured save) and the
one-time lead-time check. torchtitan's ``CheckpointManager`` is the model: the loop only says
"a step is done" (:meth:`Checkpointer.after_step`) or "save now" (:meth:`Checkpointer.save`).

The commit protocol itself (fsync, manifest, atomic rename, prune) is :mod:`recovery.commit`;
the shard format is Megatron-Core's ``dist_checkpointing`` (:mod:`train.megatron_ckpt`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from recovery.interval import parse_interval, resolve_interval
from recovery.resume import Resume
from train.context import RankContext, broadcast, model_shape


@dataclass
class Start:
    """Rank 0's verdict before the model is built, as every rank receives it."""

    resume: Resume  # the newest verified checkpoint (path None: start from scratch)
    decision: dict = field(default_factory=dict)  # recovery.policy.Decision as a dict

    @property
    def ok(self) -> bool:
        return bool(self.decision["ok"])


def find_start(ctx: RankContext) -> Start:
    """Rank 0 finds the newest verified checkpoint and asks the requeue policy; all ranks get the answer."""
    from recovery import policy
    from recovery.resume import find_latest_verified

    start = None
    if ctx.is_first:
        res = find_latest_verified(ctx.paths.checkpoints, storage=ctx.storage)
        decision = policy.start_decision(ctx.paths.run_dir, ctx.restart, res.step, ctx.job.training,
                                         job_id=ctx.job_id)
        start = Start(res, asdict(decision))
    return broadcast(start)


def vet_resume(ctx: RankContext, resume: Resume) -> None:
    """Before the model is built: warn about every newer checkpoint passed over, and refuse one written by
    the other optimizer type (its manifest says; the formats cannot be converted)."""
    from train import megatron_ckpt

    for path, why in resume.skipped:
        ctx.emit("resume_fallback", skipped=str(path), reason=why)
        ctx.log(f"WARNING: skipping checkpoint {path}: {why}")
    if resume.path and "distributed_optimizer" in (resume.meta or {}):
        megatron_ckpt.check_optimizer_type(resume.meta, ctx.job.parallelism.distributed_optimizer, resume.path)


class Checkpointer:
    """Saves and loads one rank's share of the training state (collective calls: every rank calls them)."""

    def __init__(self, ctx: RankContext, parts: Any) -> None:
        self.ctx = ctx
        self.parts = parts  # train.train_loop.TrainingParts
        self.interval: Optional[int] = parse_interval(ctx.job.training.checkpoint_interval)  # None: auto, unmeasured
        self.saved_steps: set[int] = set()
        self._lead_checked = False

    # ---- resume ---------------------------------------------------------------------------

    def load(self, resume: Resume) -> Any:
        """Restore model, optimizer and schedule from ``resume`` (any saved layout); the TrainState to go on from."""
        from train import megatron_ckpt
        from train.train_loop import TrainState

        ctx = self.ctx
        if not resume.path:
            return TrainState()
        ctx.log(f"loading checkpoint from {resume.path} at iteration {resume.step}")
        chunks, optimizer, scheduler = self.parts
        loaded = megatron_ckpt.load(resume.path, chunks, optimizer, scheduler,
                                    distributed_optimizer=self._distributed_optimizer)
        ts = loaded.training_state
        state = TrainState(step=int(ts["step"]), consumed_samples=int(ts["consumed_samples"]))
        ctx.log(f"  successfully loaded checkpoint from {resume.path} at iteration {state.step} "
                f"({loaded.seconds:.2f} s)")
        ctx.emit("resume", step=state.step, checkpoint=str(resume.path), consumed_samples=state.consumed_samples,
                 from_layout=ts.get("layout"), seconds=loaded.seconds)
        self.saved_steps.add(state.step)
        return state

    # ---- save -----------------------------------------------------------------------------

    def after_step(self, state: Any, step_s: float, iters: int) -> None:
        """A step is done: save at the interval (the first step resolves ``auto``); never after the last step."""
        if state.step >= iters:
            return  # the final save is save_final's
        save_s = 0.0
        if self.interval is None:
            save_s = self.save(state, "interval")
            self.interval = self._resolve_auto(step_s, save_s)
        elif state.step % self.interval == 0:
            save_s = self.save(state, "interval")
        if save_s > 0 and not self._lead_checked:  # the first measured save: is the lead time enough?
            self._check_lead(step_s, save_s)
            self._lead_checked = True

    def save_final(self, state: Any) -> None:
        """At the end of training: make the last step durable unless it already is."""
        if state.step not in self.saved_steps:
            self.save(state, "final")

    def save(self, state: Any, reason: str) -> float:
        """Every rank: a checkpoint of ``state`` (reason: interval | signal | final); its seconds (0: none needed)."""
        from recovery.signals import deferred

        if state.step == 0 or state.step in self.saved_steps:
            # Nothing new to make durable: a step-0 checkpoint holds no optimizer state (Adam's
            # is created by the first step) and would break the next attempt's load; a step
            # already committed needs no second copy. A stop here requeues without saving, and
            # the zero-progress guard counts it as a restart that made no progress.
            self.ctx.log(f"no checkpoint needed at iteration {state.step} ({reason}): "
                         f"{'nothing trained yet' if state.step == 0 else 'already saved'}")
            return 0.0
        with deferred():  # a stop signal during the save is delivered after it (recovery/signals.py)
            return self._save(state, reason)

    def _save(self, state: Any, reason: str) -> float:
        """Stage (rank 0), write shards (all), commit (rank 0), with a barrier between each."""
        import torch.distributed as dist

        from recovery import commit
        from train import megatron_ckpt

        ctx, step = self.ctx, state.step
        t0 = ctx.clock()
        final = ctx.paths.checkpoint(step)
        ctx.log(f"saving checkpoint at iteration {step:7d} to {final}")
        if ctx.is_first:
            commit.prepare_staging(ctx.paths.checkpoints, step, storage=ctx.storage)
        dist.barrier()
        meta = self._meta(state)
        chunks, optimizer, scheduler = self.parts
        sd = megatron_ckpt.sharded_state(chunks, optimizer, scheduler, meta,
                                         distributed_optimizer=self._distributed_optimizer, is_loading=False)
        megatron_ckpt.save_shards(ctx.paths.staging(step), sd, distributed_optimizer=self._distributed_optimizer)
        dist.barrier()
        if ctx.is_first:
            if ctx.hooks.save_sleep_s > 0:
                ctx.sleep(ctx.hooks.save_sleep_s)
            result = commit.commit(ctx.paths.checkpoints, step, meta, keep=ctx.job.training.keep_checkpoints,
                                   storage=ctx.storage)
            ctx.emit("checkpoint_saved", step=step, path=str(result.path), seconds=ctx.clock() - t0,
                     bytes=result.bytes, reason=reason)
        dist.barrier()
        self.saved_steps.add(step)
        seconds = ctx.clock() - t0
        ctx.log(f"  successfully saved checkpoint at iteration {step:7d} to {final} ({seconds:.2f} s)")
        return seconds

    def _meta(self, state: Any) -> dict:
        """The manifest's summary: enough for a resume to refuse an incompatible checkpoint unopened."""
        job = self.ctx.job
        return {
            "step": state.step, "consumed_samples": state.consumed_samples, "layout": self.ctx.layout,
            "distributed_optimizer": self._distributed_optimizer, "restart_count": self.ctx.restart,
            "model": model_shape(job), "seed": job.training.seed,
        }

    # ---- interval and lead time -------------------------------------------------------------

    def _resolve_auto(self, step_s: float, save_s: float) -> int:
        job = self.ctx.job
        steps, why = resolve_interval(job.training.checkpoint_interval, save_s=save_s, step_s=step_s,
                                      node_mtbf_hours=job.cluster.node_mtbf_hours, nodes=job.cluster.nodes)
        self.ctx.emit("checkpoint_interval", interval=steps, reasoning=why)
        self.ctx.log(f"checkpoint interval: {why}")
        return steps

    def _check_lead(self, step_s: float, save_s: float) -> None:
        from recovery import policy

        lead = self.ctx.job.training.signal_lead_time_s
        warn = policy.lead_time_warning(lead, step_s, save_s)
        if warn:
            self.ctx.log(f"WARNING: {warn}")
            self.ctx.emit("lead_time_warning", lead_s=lead, step_s=step_s, save_s=save_s, detail=warn)

    @property
    def _distributed_optimizer(self) -> bool:
        return bool(self.ctx.job.parallelism.distributed_optimizer)
