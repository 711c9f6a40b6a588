"""Replay parity: a resumed run proves its checkpoint by recomputing steps the lost attempt already logged.

After an interruption the steps between the checkpoint and the failure are trained again, and the
attempt that was lost logged their loss and grad norm (``iteration`` events, ``repr`` of the float:
exact). With the same data order, the same numerics (layout, world size, precision, micro-batch size,
device) and the same recipe (model, optimizer, schedule, seed, batch), a replayed step reproduces those
numbers **bitwise** (the training loop re-seeds every RNG from (seed, step) and addresses data by
sample index; every fault test of this repository shows it). In another layout the sums run in another
order: equal within a relative tolerance (``training.replay.rtol``; a TP2 checkpoint resumed under PP2
differs by ~2.4e-8 relative on CPU fp32, a lost or shared optimizer state by ~5e-3). A mismatch means the
checkpoint holds the right bytes of the wrong state (an optimizer shard from the wrong bucket, a wrong
data position), or determinism is broken: the SHA-256 manifest cannot see either.

This module is the pure part (no torch, no I/O): what the event log says was logged
(:func:`logged_steps`), whether bitwise is expected (:func:`expectation`), the comparison of one step
(:func:`compare`), the policy (:func:`resolve_policy`) and the check over the first replayed steps
(:class:`ReplayCheck`). ``train/replay_parity.py`` wires it into the ranks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

POLICIES = ("auto", "warn", "stop", "rollback")
MAX_ROLLBACKS = 1  # per attempt: a second mismatch after a rollback stops (determinism itself may be broken)


@dataclass(frozen=True)
class Logged:
    """One step as an earlier attempt logged it."""

    step: int
    loss: float
    grad_norm: float
    consumed_samples: Optional[int]
    numerics: Optional[dict]  # the logging attempt's job_start 'numerics' (None: an attempt before they were logged)
    recipe: Optional[str]  # the logging attempt's job_start 'recipe' digest
    attempt: tuple  # (job_id, restart_count) of the logging attempt


def _float(x: Any) -> Optional[float]:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def logged_steps(events: Iterable[dict]) -> dict[int, Logged]:
    """step -> the first logged record of that step in ``events`` (the run's event log, oldest first).

    The first record is the step as it was first computed; a later attempt that replayed it logged it again, and
    if that replay was wrong (a mismatch under ``warn``, or the attempt a mismatch stopped) its records must not
    become what the next resume is compared with. Each ``iteration`` record is tied to the ``job_start`` of its
    attempt (same job id and restart count) for the numerics and the recipe it ran with. A ``start_over``
    forgets everything before it."""
    starts: dict[tuple, dict] = {}
    out: dict[int, Logged] = {}
    for e in events:
        kind = e.get("event")
        key = (e.get("job_id"), e.get("restart_count"))
        if kind == "start_over":
            out.clear()
        elif kind == "job_start":
            starts[key] = e
        elif kind == "iteration":
            step, loss, norm = e.get("step"), _float(e.get("loss")), _float(e.get("grad_norm"))
            if not isinstance(step, int) or loss is None or norm is None:
                continue
            if step in out:
                continue
            js = starts.get(key) or {}
            consumed = e.get("consumed_samples")
            out[step] = Logged(step, loss, norm, consumed if isinstance(consumed, int) else None,
                               js.get("numerics"), js.get("recipe"), key)
    return out


def expectation(logged: Iterable[Logged], numerics: dict, recipe: str) -> tuple[str, str]:
    """("bitwise" | "tolerance" | "off", why) for replaying ``logged`` under this attempt's numerics and recipe.

    Bitwise when every logging attempt ran the same numerics; within the tolerance when only numerics
    differ (layout, world size, precision, micro-batch size, device); off when the recipe differs (another
    learning rate, schedule length, batch, model or seed trains other numbers: there is nothing to match)
    or an attempt did not record them."""
    logged = list(logged)
    if not logged:
        return "off", "no replayed step was logged by an earlier attempt"
    if any(x.recipe is None or x.numerics is None for x in logged):
        return "off", "the logging attempt did not record its numerics"
    if any(x.recipe != recipe for x in logged):
        return "off", ("the recipe changed since the logging attempt (model, optimizer, schedule, batch or seed): "
                       "other numbers are expected")
    differ = sorted({k for x in logged for k in set(x.numerics) | set(numerics)
                     if x.numerics.get(k) != numerics.get(k)})
    if differ:
        return "tolerance", f"{', '.join(differ)} differ from the logging attempt"
    return "bitwise", "same layout, precision and world size as the logging attempt"


def resolve_policy(configured: str, mode: str) -> str:
    """``training.replay.on_mismatch``: ``auto`` is ``stop`` when bitwise was expected, else ``warn``."""
    if configured == "auto":
        return "stop" if mode == "bitwise" else "warn"
    return configured


@dataclass(frozen=True)
class Diff:
    step: int
    field: str  # loss | grad_norm | consumed_samples
    logged: Any
    replayed: Any
    rel: Optional[float]  # |replayed - logged| / |logged| (None for the data position)


def _json_float(x: Optional[float]) -> Any:
    """A float for a JSON event (inf and nan as their repr: JSON has no such numbers)."""
    return x if x is None or math.isfinite(x) else repr(x)


def rel_diff(a: float, b: float) -> float:
    """|b - a| / |a| (inf when a non-finite value meets a finite one; 0 when both are the same)."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(b - a) / abs(a) if a else math.inf


def compare(logged: Logged, loss: float, grad_norm: float, consumed: Optional[int], *, mode: str,
            rtol: float) -> list[Diff]:
    """The differences of one replayed step from its logged record: bitwise (``mode='bitwise'``: any bit
    differs) or beyond ``rtol`` (relative). The data position must be equal in every mode."""
    diffs = []
    if logged.consumed_samples is not None and consumed is not None and consumed != logged.consumed_samples:
        diffs.append(Diff(logged.step, "consumed_samples", logged.consumed_samples, consumed, None))
    for name, want, got in (("loss", logged.loss, loss), ("grad_norm", logged.grad_norm, grad_norm)):
        rel = rel_diff(want, got)
        if (mode == "bitwise" and rel != 0.0) or (mode != "bitwise" and not rel <= rtol):
            diffs.append(Diff(logged.step, name, repr(want), repr(got), rel))
    return diffs


@dataclass
class Verdict:
    """The end of a replay check: every number a person needs, as a line and as event fields."""

    match: bool
    mode: str  # bitwise | tolerance
    steps: list  # the steps compared
    policy: str  # the resolved policy (a match has nothing to follow)
    max_rel: float = 0.0
    diffs: list = field(default_factory=list)  # [Diff]: the mismatching step's differences

    def span(self) -> str:
        a, b = self.steps[0], self.steps[-1]
        return f"step {a}" if a == b else f"steps {a}\u2013{b}"

    def line(self, rtol: float) -> str:
        if self.match:
            how = "bitwise" if self.mode == "bitwise" else (
                f"within the relative tolerance {rtol:g} (largest difference {self.max_rel:.2g}; the layout differs)")
            verb = "matches" if len(self.steps) == 1 else "match"
            return f"replayed {self.span()} {verb} the lost attempt {how}"
        d = self.diffs
        said = "; ".join(f"{x.field} logged {x.logged} replayed {x.replayed}"
                         + (f" (relative {x.rel:.3g})" if x.rel is not None else "") for x in d)
        want = "bitwise" if self.mode == "bitwise" else f"within relative {rtol:g}"
        return (f"replayed step {d[0].step} does not match the lost attempt ({want} expected): {said}; the checkpoint "
                f"(its optimizer state or data position) or determinism is wrong "
                f"(training.replay.on_mismatch={self.policy})")

    def fields(self) -> dict:
        out: dict = {"mode": self.mode, "steps": list(self.steps), "policy": self.policy,
                     "max_rel": _json_float(self.max_rel)}
        if self.diffs:
            out["step"] = self.diffs[0].step
            out["diffs"] = [{"field": x.field, "logged": x.logged, "replayed": x.replayed, "rel": _json_float(x.rel)}
                            for x in self.diffs]
        return out


class ReplayCheck:
    """The first ``limit`` replayed steps after ``start`` that an earlier attempt logged, compared one by one.

    :meth:`on_step` returns None while the check goes on (or has nothing to say), and a :class:`Verdict`
    once: at the first mismatching step, or when the last step to check matched. Every rank holds the same
    table and sees the same loss and grad norm (both reduced over the ranks), so every rank reaches the same
    verdict at the same step without a collective."""

    def __init__(self, logged: dict[int, Logged], start: int, limit: int, *, mode: str, rtol: float,
                 policy: str) -> None:
        self.logged, self.mode, self.rtol, self.policy = logged, mode, rtol, resolve_policy(policy, mode)
        self.todo = sorted(s for s in logged if s > start)[:max(0, limit)] if mode != "off" else []
        self.done: list = []
        self.max_rel = 0.0

    @property
    def pending(self) -> bool:
        """Steps are still to be compared (periodic saves wait: a state that may be wrong is not saved)."""
        return bool(self.todo)

    def on_step(self, step: int, loss: float, grad_norm: float, consumed: Optional[int]) -> Optional[Verdict]:
        if not self.todo or step != self.todo[0]:
            if self.todo and step > self.todo[0]:  # a step not replayed (a skip): that record cannot be compared
                self.todo = [s for s in self.todo if s > step]
            return None
        self.todo.pop(0)
        diffs = compare(self.logged[step], loss, grad_norm, consumed, mode=self.mode, rtol=self.rtol)
        lg = self.logged[step]
        self.max_rel = max(self.max_rel, rel_diff(lg.loss, loss), rel_diff(lg.grad_norm, grad_norm))
        self.done.append(step)
        if diffs:
            self.todo = []
            return Verdict(False, self.mode, list(self.done), self.policy, self.max_rel, diffs)
        if not self.todo:
            return Verdict(True, self.mode, list(self.done), self.policy, self.max_rel)
        return None

    def partial(self) -> Optional[Verdict]:
        """The loop ended (a stop, the last step) before every step was checked: the match so far, if any."""
        if not self.todo or not self.done:
            return None
        self.todo = []
        return Verdict(True, self.mode, list(self.done), self.policy, self.max_rel)
