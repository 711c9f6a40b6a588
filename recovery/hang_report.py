"""What a hung attempt looked like: deadlines with their arithmetic, suspects and victims.

Pure functions over plain data (no clock, no processes, no torch), shared by the watcher
(:mod:`recovery.watchdog`) and its tests.

Deadlines
---------
A rank reports *heartbeats*: ``startup`` (process up), ``load`` (checkpoint load begins),
``train`` (model built, the first step begins), ``step`` (a step finished), ``save`` (a
save begins), ``saved`` (it is durable), ``done`` (training ended). :class:`Watch` turns them
into one deadline at a time:

* until the first ``step``: ``training.watchdog.startup_s`` from the start of the rank (start-up,
  checkpoint load and the first step together);
* after a ``step``/``saved``: ``max(training.watchdog.step_factor x median step interval,
  training.watchdog.step_floor_s)`` from that heartbeat; the median is over the intervals the
  watcher itself saw between consecutive step heartbeats (the first step's own time until
  a second one exists);
* during a save: ``max(training.watchdog.save_factor x slowest measured save,
  training.watchdog.save_floor_s)``, or ``startup_s`` before any save was measured;
* after ``done``: ``startup_s`` (shutdown).

Suspects and victims
--------------------
On a miss every rank's watcher writes a report: its rank's last heartbeat (a sequence number,
the same on every rank at the same point of the program), the process state from
``/proc/PID/stat`` and the Python stacks. :func:`classify` names a rank a **suspect** when it
is stopped (state ``T``), is behind the furthest heartbeat, or, at the same heartbeat, its
main thread is *not* inside ``torch.distributed`` (sleeping in the data path, stuck in a
read, busy in a save); the others are **victims** (waiting in a collective for a suspect).
A hang where every rank waits in a collective at the same heartbeat has no suspect: the
network or a collective itself hung.
"""
from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from typing import Mapping, Optional

PHASES = ("startup", "load", "train", "step", "save", "saved", "done")
STEP_WINDOW = 50  # intervals kept for the median


@dataclass(frozen=True)
class Limits:
    """The ``training.watchdog`` settings (:class:`launch.watchdog_config.WatchdogConfig`, same names; its
    defaults are the only ones)."""

    startup_s: float
    step_factor: float
    step_floor_s: float
    save_factor: float
    save_floor_s: float

    @staticmethod
    def of(watchdog: object) -> "Limits":
        g = lambda name: float(getattr(watchdog, name))  # noqa: E731
        return Limits(g("startup_s"), g("step_factor"), g("step_floor_s"), g("save_factor"), g("save_floor_s"))


@dataclass(frozen=True)
class Deadline:
    at: float  # clock value
    what: str  # startup | step | save | shutdown
    seconds: float
    arithmetic: str


@dataclass
class Watch:
    """The deadline state machine of one rank; fed heartbeats with the watcher's clock."""

    limits: Limits
    started: float
    seq: int = 0
    phase: str = "startup"
    step: int = 0
    last: float = 0.0  # clock of the last heartbeat
    steps_seen: int = 0
    step_intervals: list = field(default_factory=list)
    saves: list = field(default_factory=list)
    _prev_step_at: Optional[float] = None

    def __post_init__(self) -> None:
        self.last = self.started

    def beat(self, seq: int, phase: str, step: int, seconds: float, now: float) -> None:
        if phase == "step":
            if self._prev_step_at is not None:
                self.step_intervals.append(now - self._prev_step_at)
            elif seconds > 0:
                self.step_intervals.append(seconds)  # the first step: its own time
            del self.step_intervals[:-STEP_WINDOW]
            self.steps_seen += 1
            self._prev_step_at = now
        elif phase == "saved":
            if seconds > 0:
                self.saves.append(seconds)
            self._prev_step_at = None  # the next interval would include the save
        elif phase in ("save", "load", "train"):
            self._prev_step_at = None
        self.seq, self.phase, self.step, self.last = seq, phase, step, now

    def step_deadline(self) -> tuple[float, str]:
        lim = self.limits
        med = statistics.median(self.step_intervals) if self.step_intervals else 0.0
        s = max(lim.step_factor * med, lim.step_floor_s)
        return s, (f"max(training.watchdog.step_factor {lim.step_factor:g} x median step {med:.3f} s "
                   f"over {len(self.step_intervals)} step(s), training.watchdog.step_floor_s {lim.step_floor_s:g}) "
                   f"= {s:.1f} s")

    def deadline(self) -> Deadline:
        lim = self.limits
        if self.phase == "done":
            return Deadline(self.last + lim.startup_s, "shutdown", lim.startup_s,
                            f"training.watchdog.startup_s = {lim.startup_s:g} s after training ended")
        if self.phase == "save":
            if self.saves:
                slow = max(self.saves)
                s = max(lim.save_factor * slow, lim.save_floor_s)
                why = (f"max(training.watchdog.save_factor {lim.save_factor:g} x slowest save {slow:.2f} s, "
                       f"training.watchdog.save_floor_s {lim.save_floor_s:g}) = {s:.1f} s")
            else:
                s = max(lim.startup_s, lim.save_floor_s)
                why = f"no save measured yet: max(training.watchdog.startup_s, save_floor_s) = {s:g} s"
            return Deadline(self.last + s, "save", s, why)
        if self.steps_seen == 0:
            return Deadline(self.started + lim.startup_s, "startup", lim.startup_s,
                            f"training.watchdog.startup_s = {lim.startup_s:g} s from the rank's start to its first step")
        s, why = self.step_deadline()
        return Deadline(self.last + s, "step", s, why)


# ---- reports ------------------------------------------------------------------------------

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)", re.M)
_FRAME = re.compile(r'^\s+File "([^"]+)", line (\d+) in (\S+)', re.M)


def main_thread_frames(stacks: str) -> list[tuple[str, int, str]]:
    """(file, line, function) of the main thread, innermost first, from a faulthandler dump.

    The main thread is the one whose outermost frame is a ``<module>`` (the script or
    ``runpy``); a dump without one falls back to the thread that took the signal.
    """
    blocks: list[tuple[str, str]] = []
    starts = list(_THREAD.finditer(stacks))
    for i, m in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(stacks)
        blocks.append((m.group(1), stacks[m.end():end]))
    parsed = [(kind, [(f, int(n), fn) for f, n, fn in _FRAME.findall(text)]) for kind, text in blocks]
    for _kind, frames in parsed:
        if frames and any(fn == "<module>" for _f, _n, fn in frames):
            return frames
    for kind, frames in parsed:
        if kind == "Current thread":
            return frames
    return parsed[0][1] if parsed else []


def collective_frame(frames: list[tuple[str, int, str]]) -> Optional[str]:
    """The innermost ``torch.distributed`` frame of ``frames`` (the collective it waits in), or None."""
    for f, n, fn in frames:
        if "torch/distributed/" in f.replace("\\", "/"):
            return f"{fn} ({f.rsplit('/', 1)[-1]}:{n})"
    return None


def innermost_own_frame(frames: list[tuple[str, int, str]]) -> Optional[str]:
    """The innermost frame outside the standard library and site-packages (where our code is)."""
    for f, n, fn in frames:
        g = f.replace("\\", "/")
        if "site-packages" not in g and "/lib/python" not in g:
            return f"{fn} ({g.rsplit('/', 2)[-2] + '/' + g.rsplit('/', 1)[-1] if '/' in g else g}:{n})"
    return f"{frames[0][2]} ({frames[0][0].rsplit('/', 1)[-1]}:{frames[0][1]})" if frames else None


def classify(reports: Mapping[int, dict], world: int) -> dict:
    """Suspects and victims from the watchers' reports (rank -> report dict).

    A report holds ``seq``, ``phase``, ``step``, ``host``, ``proc_state`` and ``stacks``
    (faulthandler text, '' if the dump failed). Returns ``{"suspects": [...], "victims":
    [...], "unknown": [...], "furthest": {seq, phase, step}}``; each entry is
    ``{rank, host, why}``.
    """
    present = {r: rep for r, rep in reports.items() if rep is not None}
    top = max((int(rep.get("seq", 0)) for rep in present.values()), default=0)
    top_rep = next((rep for rep in present.values() if int(rep.get("seq", 0)) == top), {})
    out: dict = {"suspects": [], "victims": [], "unknown": [],
                 "furthest": {"seq": top, "phase": top_rep.get("phase"), "step": top_rep.get("step")}}
    for r in range(world):
        rep = present.get(r)
        if rep is None:
            out["unknown"].append({"rank": r, "host": None, "why": "no report from its watcher"})
            continue
        host = rep.get("host")
        seq = int(rep.get("seq", 0))
        frames = main_thread_frames(rep.get("stacks") or "")
        coll = collective_frame(frames)
        where = innermost_own_frame(frames)
        at = f"heartbeat #{seq} ({rep.get('phase')} @ iteration {rep.get('step')})"
        if str(rep.get("proc_state", "")).upper().startswith("T"):
            out["suspects"].append({"rank": r, "host": host, "why": f"process stopped (state T) after {at}"})
        elif seq < top:
            out["suspects"].append({"rank": r, "host": host, "why": (
                f"did not reach the last heartbeat: {at} < #{top} ({top_rep.get('phase')} @ iteration "
                f"{top_rep.get('step')}); in {coll or where or 'no stack'}")})
        elif not frames:
            out["suspects"].append({"rank": r, "host": host, "why": (
                f"no stack dump (state {rep.get('proc_state') or '?'}: uninterruptible I/O?) at {at}")})
        elif coll is None:
            out["suspects"].append({"rank": r, "host": host, "why": f"not in a collective at {at}: in {where}",
                                    "_weak": True})
        else:
            out["victims"].append({"rank": r, "host": host, "why": f"waiting in {coll} at {at}"})
    return _peers_explain(out)


def _peers_explain(out: dict) -> dict:
    """A rank outside any collective frame *we know* is a suspect only when no peer is one for a sure reason.

    With a peer stopped (state T), behind the last heartbeat, or stuck without a stack, a rank that reached the
    last heartbeat and is alive is waiting for that peer, in whatever frame its wait shows (a collective's
    ``Work.wait()`` is C++ under a Megatron or CPU-shim frame, invisible as a ``torch.distributed`` frame): it is
    a victim, and the suspect set is exactly the ranks that did not reach the collective."""
    sure = [s for s in out["suspects"] if not s.get("_weak")]
    weak = [s for s in out["suspects"] if s.get("_weak")]
    if sure and weak:
        names = ", ".join(f"rank {s['rank']}" for s in sure)
        out["suspects"] = sure
        out["victims"] = sorted(out["victims"] + [
            {"rank": s["rank"], "host": s["host"],
             "why": s["why"].replace("not in a collective at", "alive at", 1) + f"; waiting for {names}"}
            for s in weak], key=lambda v: v["rank"])
    for s in out["suspects"]:
        s.pop("_weak", None)
    return out


def repeat_offenders(current: dict, previous: Optional[dict]) -> list[str]:
    """Hosts named as suspects in this hang and in the previous attempt's hang (twice in a row)."""
    if not previous:
        return []
    before = {s.get("host") for s in previous.get("suspects", []) if s.get("host")}
    return sorted({s["host"] for s in current.get("suspects", []) if s.get("host") in before})


def describe(summary: dict) -> str:
    """One paragraph for the log."""
    def names(items: list) -> str:
        return ", ".join(f"rank {x['rank']} on {x['host']}" for x in items) or "none"

    lines = [f"hang: {summary.get('missed', {}).get('what', '?')} deadline missed "
             f"({summary.get('missed', {}).get('arithmetic', '')}); suspects: {names(summary['suspects'])}; "
             f"victims: {names(summary['victims'])}"]
    for s in summary["suspects"]:
        lines.append(f"  suspect rank {s['rank']} ({s['host']}): {s['why']}")
    for v in summary["victims"]:
        lines.append(f"  victim rank {v['rank']} ({v['host']}): {v['why']}")
    for u in summary["unknown"]:
        lines.append(f"  rank {u['rank']}: {u['why']}")
    return "\n".join(lines)
