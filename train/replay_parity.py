"""Replay parity on the ranks: the first steps replayed after a resume against the lost attempt's log.

The rules (what was logged, bitwise or a tolerance, the policy) are :mod:`recovery.replay`; this module
gives them the job's numerics and recipe, reads the event log (rank 0, before this attempt logs a step:
``iteration`` events hold ``repr`` of the loss and grad norm), hands every rank the steps to compare, and
acts on the verdict: a match is an event and a line; a mismatch is a WARNING and a ``replay_mismatch``
event, then ``warn`` (train on), ``stop`` (final, exit 16, nothing deleted) or ``rollback`` (quarantine the
checkpoint this replay started from, load the previous verified one, replay again; once per attempt).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Optional

from launch.kinds import EventKind
from recovery.events import read_events
from recovery.replay import MAX_ROLLBACKS, Logged, ReplayCheck, Verdict, expectation, logged_steps
from train.checkpointer import Checkpointer
from train.context import RankContext, broadcast, layout_of

# what trains other numbers when it changes (then nothing is compared): the optimisation recipe
RECIPE_FIELDS = ("global_batch_size", "lr", "min_lr", "lr_warmup_iters", "lr_decay_style", "weight_decay",
                 "adam_beta1", "adam_beta2", "clip_grad", "seed", "initial_loss_scale", "loss_scale_window",
                 "hysteresis")


def _plain(x: Any) -> Any:
    """``x`` as it reads back from the event log (JSON: enums as strings, tuples as lists)."""
    return json.loads(json.dumps(x, default=str, sort_keys=True))


def numerics_of(job: Any, world: int, cuda: bool) -> dict:
    """What changes the order of the sums but not the math: compared within ``training.replay.rtol``."""
    t = job.training
    return _plain({"layout": layout_of(job), "parallelism": dataclasses.asdict(job.parallelism), "world_size": world,
                   "precision": t.precision, "micro_batch_size": t.micro_batch_size,
                   "device": "cuda" if cuda else "cpu"})


def recipe_of(job: Any) -> str:
    """A digest of what defines the numbers themselves (model, data, optimizer, schedule, seed, batch, length)."""
    t = job.training
    doc = {"model": dataclasses.asdict(job.model), "data": dataclasses.asdict(job.data),
           "iterations": job.iterations, "training": {k: getattr(t, k, None) for k in RECIPE_FIELDS}}
    return hashlib.sha256(json.dumps(_plain(doc), sort_keys=True).encode()).hexdigest()[:16]


class ReplayParity:
    """One attempt's replay check (every rank holds one; rank 0 also holds the whole logged table)."""

    def __init__(self, ctx: RankContext, state: Any) -> None:
        self.ctx = ctx
        r = ctx.job.training.replay
        self.limit, self.rtol, self.configured = int(r.check_steps), float(r.rtol), r.on_mismatch
        self.numerics, self.recipe = numerics_of(ctx.job, ctx.world, bool(ctx.cuda)), recipe_of(ctx.job)
        self.table: dict[int, Logged] = {}
        self.rolled_back: set = set()  # steps whose logged record already cost a checkpoint (earlier attempts)
        if ctx.is_first and self.limit > 0:  # read before this attempt logs a step: every record is an earlier one
            events = read_events(ctx.paths.events)
            self.table = logged_steps(events)
            self.rolled_back = {e["step"] for e in events if e.get("event") == EventKind.REPLAY_ROLLBACK
                                and isinstance(e.get("step"), int) and not isinstance(e.get("step"), bool)}
        self.rollbacks = 0
        self.detail = ""
        self.check: Optional[ReplayCheck] = None
        self.begin(state.step)

    def begin(self, start: int) -> None:
        """Every rank (collective): compare the first replayed steps after ``start``."""
        payload = None
        if self.ctx.is_first:
            steps = sorted(s for s in self.table if s > start)[:max(0, self.limit)]
            mode, why = expectation([self.table[s] for s in steps], self.numerics, self.recipe)
            payload = ({s: self.table[s] for s in steps}, mode, why, sorted(self.rolled_back))
        todo, mode, why, rolled_back = broadcast(payload)
        self.rolled_back = set(rolled_back)
        self.check = ReplayCheck(todo, start, self.limit, mode=mode, rtol=self.rtol, policy=self.configured)
        if todo and mode == "off":
            self.ctx.log(f"replay check off: {why}")
            self.ctx.emit(EventKind.REPLAY_CHECK_OFF, step=start, detail=why)

    @property
    def pending(self) -> bool:
        return self.check is not None and self.check.pending

    def after_step(self, state: Any, loss: float, grad_norm: float) -> str:
        """After a step is applied: "" (go on), "stop" or "rollback"."""
        if self.check is None:
            return ""
        verdict = self.check.on_step(state.step, loss, grad_norm, state.consumed_samples)
        if verdict is None:
            return ""
        return self._said(verdict)

    def finish(self) -> None:
        """The loop ended: a check cut short by the end is reported with the steps it compared."""
        if self.check is not None and (verdict := self.check.partial()) is not None:
            self._said(verdict)

    def _said(self, v: Verdict) -> str:
        ctx = self.ctx
        line = v.line(self.rtol)
        if v.match:
            ctx.log(line)
            ctx.emit(EventKind.REPLAY_MATCH, detail=line, **v.fields())
            return ""
        ctx.log(f"WARNING: {line}")
        ctx.emit(EventKind.REPLAY_MISMATCH, detail=line, **v.fields())
        self.detail = line
        if v.policy == "warn":
            return ""
        if v.policy == "rollback" and self.rollbacks >= MAX_ROLLBACKS:
            self.detail = f"{line}; {self.rollbacks} rollback(s) already done in this attempt: stopping"
            return "stop"
        step = v.diffs[0].step if v.diffs else v.steps[-1]
        if v.policy == "rollback" and step in self.rolled_back:  # the same evidence never costs a second checkpoint
            self.detail = (f"{line}; the logged record of step {step} already had a checkpoint quarantined in an "
                           f"earlier attempt (a replay_rollback event), so the log itself may be wrong (an edited "
                           f"events.jsonl?): stopping instead of quarantining another. Compare the logged losses "
                           f"with the rank logs; {ctx.paths.checkpoints / 'quarantine'} holds what was moved (mv "
                           f"it back to resume from it)")
            return "stop"
        return v.policy

    def rollback(self, ckpt: Checkpointer, state: Any) -> Optional[Any]:
        """Quarantine the checkpoint this replay started from, load the previous verified one and replay again;
        None (then stop) when there is none."""
        back = ckpt.replay_rollback(state, self.detail)
        if back is None:
            self.detail += "; no earlier verified checkpoint to roll back to"
            return None
        self.rollbacks += 1
        self.begin(back.step)
        return back

