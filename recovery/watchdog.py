"""The hang watchdog: one watcher process per rank that turns a hang into a requeue.

A hung collective is not a process failure: nothing exits, nothing requeues, and the job
holds its nodes until the process-group timeout (30 min) or the time limit. So every rank
starts, right after its signal handlers, a small watcher (``python -m recovery.watchdog``,
standard library only: no torch) as its child:

* the rank writes a heartbeat line to the watcher's stdin (a pipe) at every step boundary
  and phase change (:class:`Heartbeat`; a non-blocking write of ~30 bytes);
* the watcher enforces the deadlines of :class:`recovery.hang_report.Watch`; it ignores the
  stop signals (Slurm sends ``--signal`` and preemption SIGTERM to every process of the step)
  and ends when its rank does (end of file on the pipe);
* the rank registers :mod:`faulthandler` on ``SIGQUIT`` writing into a second pipe that the
  watcher reads, so the watcher can take the rank's Python stacks (every thread) even when
  the rank is blocked inside C code; a stopped rank gets ``SIGCONT`` to let the handler run
  and is stopped again after the dump;

On a missed deadline (or when another rank's watcher already declared the hang: the file
``trigger.json`` in the hang directory) each watcher writes into
``<run_dir>/hangs/<job>_<attempt>/`` its rank's stacks (``rank<R>.stacks.txt``) and report
(``rank<R>.json``). The watcher of rank 0 waits for every report, names suspects and
victims (:func:`recovery.hang_report.classify`), writes ``summary.json``, records the
``hang``, ``stop`` (reason ``hang``) and ``exit`` (reason ``hang``) events, and, when the
same host was a suspect in the previous attempt's hang too, records it as a failed node
(:func:`recovery.policy.record_failed_node`: the next attempt is moved away from it). Then
every watcher kills its rank (``SIGKILL``): the step fails, and the batch script requeues
through :mod:`recovery.crash` (the local launcher and the fault harness relaunch); the
zero-progress guard bounds a hang that repeats at the same place.

Why faulthandler and not ``py-spy dump``: it needs no ptrace permission (denied in most
containers and under ``kernel.yama.ptrace_scope``), no extra binary, and costs nothing
until the signal arrives; it shows Python frames only, which is what names the place.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from launch.kinds import EventKind
from launch.paths import HANG_SUMMARY, RunPaths
from recovery import hang_report, policy
from recovery.events import EventLog
from recovery.hang_report import Limits, Watch
from recovery.storage import atomic_write_json, read_json_dict

DUMP_SIGNAL = signal.SIGQUIT  # the JVM's "thread dump" convention; never sent by Slurm
IGNORED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)
POLL_S = 0.5
DUMP_WAIT_S = 5.0
COLLECT_S = 20.0


def hang_dir(hangs: Path, job_id: Optional[str], restart: int) -> Path:
    """``<run_dir>/hangs/<job>_<attempt>`` (``local`` for runs without Slurm)."""
    return Path(hangs) / f"{job_id or 'local'}_{restart}"


# ---- the rank's side ----------------------------------------------------------------------

class Heartbeat:
    """The rank's end: starts the watcher, sends heartbeats; never blocks, never raises."""

    def __init__(self, proc: Any = None, fd: Optional[int] = None, dump_file: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.proc, self.fd, self.dump_file, self.clock = proc, fd, dump_file, clock
        self.seq = 0
        self.lost: Optional[str] = None
        self.seconds = 0.0  # time spent sending, for the overhead figure

    @staticmethod
    def disabled() -> "Heartbeat":
        return Heartbeat()

    @staticmethod
    def start(run_dir: Path, hangs: Path, limits: Limits, *, rank: int, world: int, job_id: Optional[str],
              restart: int, host: str, python: str = sys.executable) -> "Heartbeat":
        """Register the stack-dump handler and start this rank's watcher."""
        import faulthandler
        import subprocess

        dump_r, dump_w = os.pipe()
        dump_file = os.fdopen(dump_w, "w")
        faulthandler.register(DUMP_SIGNAL, file=dump_file, all_threads=True, chain=False)
        hb_r, hb_w = os.pipe()
        args = {
            "run_dir": str(run_dir), "hangs": str(hangs), "rank": rank, "world": world, "job_id": job_id,
            "restart": restart, "host": host, "rank_pid": os.getpid(), "dump_fd": dump_r,
            "limits": limits.__dict__,
        }
        root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        proc = subprocess.Popen([python, "-m", "recovery.watchdog", json.dumps(args)], stdin=hb_r,
                                pass_fds=(dump_r,), env=env, cwd=root)
        os.close(hb_r)
        os.close(dump_r)
        os.set_blocking(hb_w, False)
        return Heartbeat(proc, hb_w, dump_file)

    def beat(self, phase: str, step: int = 0, seconds: float = 0.0) -> None:
        if self.fd is None:
            return
        t0 = self.clock()
        self.seq += 1
        try:
            os.write(self.fd, f"{self.seq} {phase} {int(step)} {float(seconds):.6f}\n".encode())
        except BlockingIOError:
            pass  # the watcher is behind; the next beat carries the same information
        except OSError as e:  # the watcher is gone: say so once, keep training
            if self.lost is None:
                self.lost = f"{type(e).__name__}: {e}"
                print(f"WARNING: hang watchdog lost ({self.lost}); this rank runs unwatched", flush=True)
        self.seconds += self.clock() - t0

    def close(self) -> None:
        """Training is over: the watcher exits on end of file."""
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except Exception:  # noqa: BLE001 - it must not keep the rank from exiting
                pass


# ---- the watcher's side -------------------------------------------------------------------

def proc_state(pid: int) -> str:
    """The one-letter state of ``/proc/PID/stat`` (R, S, D, T, Z ...), '' if unknown."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        return text[text.rindex(")") + 2:].split()[0]
    except (OSError, ValueError, IndexError):
        return ""


class Watcher:
    """One rank's watcher. Side effects (clock, kill, sleep) are injectable for tests."""

    def __init__(self, args: Mapping[str, Any], *, stdin_fd: int = 0, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, kill: Callable[[int, int], None] = os.kill,
                 sleep: Callable[[float], None] = time.sleep, log: Callable[[str], None] = print,
                 parent: Callable[[], int] = os.getppid) -> None:
        self.a = dict(args)
        self.rank, self.world = int(args["rank"]), int(args["world"])
        self.pid = int(args["rank_pid"])
        self.fd, self.dump_fd = stdin_fd, int(args["dump_fd"])
        self.clock, self.wall, self.kill, self.sleep, self.log = clock, wall, kill, sleep, log
        self.parent = parent
        self.watch = Watch(Limits(**args["limits"]), started=clock())
        self.dir = hang_dir(Path(args["hangs"]), args.get("job_id"), int(args["restart"]))
        self.buf = b""
        self.announced_step_deadline = False

    def _say(self, msg: str) -> None:
        self.log(f"watchdog rank {self.rank}: {msg}")

    def _feed(self, data: bytes) -> None:
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        now = self.clock()
        for line in lines:
            parts = line.decode("ascii", "replace").split()
            if len(parts) == 4:
                self.watch.beat(int(parts[0]), parts[1], int(parts[2]), float(parts[3]), now)
        if self.watch.steps_seen >= 3 and not self.announced_step_deadline and self.rank == 0:
            self.announced_step_deadline = True
            self._say(f"step deadline {self.watch.step_deadline()[1]}")

    def run(self) -> int:
        """Watch until the rank ends (0) or a hang ends the attempt (1)."""
        while True:
            if self.parent() != self.pid:
                return 0  # the rank is gone (reparented); a forked helper may still hold the pipe open
            dl = self.watch.deadline()
            now = self.clock()
            if now >= dl.at:
                return self.on_hang(dl, own=True)
            if self.dir.joinpath("trigger.json").exists():
                return self.on_hang(dl, own=False)
            ready, _, _ = select.select([self.fd], [], [], min(POLL_S, max(0.0, dl.at - now)))
            if ready:
                data = os.read(self.fd, 65536)
                if not data:
                    return 0  # the rank closed the pipe or exited
                self._feed(data)

    # -- a hang -------------------------------------------------------------------------------

    def on_hang(self, dl: hang_report.Deadline, own: bool) -> int:
        w = self.watch
        detected = self.wall()
        self.dir.mkdir(parents=True, exist_ok=True)
        missed = {"what": dl.what, "seconds": dl.seconds, "arithmetic": dl.arithmetic, "rank": self.rank,
                  "since_last_heartbeat_s": self.clock() - w.last, "time": detected}
        if own:
            try:  # the first watcher to miss records the deadline; the others follow the trigger
                fd = os.open(self.dir / "trigger.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                with os.fdopen(fd, "w") as f:
                    json.dump(missed, f)
                self._say(f"{dl.what} deadline missed: no heartbeat for {missed['since_last_heartbeat_s']:.1f} s "
                          f"after #{w.seq} ({w.phase} @ iteration {w.step}); {dl.arithmetic}")
            except FileExistsError:
                pass
        state = proc_state(self.pid)
        stacks = self.dump_stacks(state)
        (self.dir / f"rank{self.rank}.stacks.txt").write_text(stacks or "(no stack dump within "
                                                               f"{DUMP_WAIT_S:g} s; process state {state})\n")
        report = {"rank": self.rank, "host": self.a.get("host"), "pid": self.pid, "proc_state": state,
                  "seq": w.seq, "phase": w.phase, "step": w.step, "own_miss": own, "detected": detected,
                  "dump": "faulthandler", "stacks": stacks}
        atomic_write_json(self.dir / f"rank{self.rank}.json", report)
        if self.rank == 0:
            self.coordinate(detected)
        else:
            self._wait_for(lambda: (self.dir / HANG_SUMMARY).exists(), COLLECT_S + DUMP_WAIT_S)
        self.end_rank()
        return 1

    def dump_stacks(self, state: str) -> str:
        """The rank's stacks through its faulthandler pipe ('' if nothing came)."""
        stopped = state.upper().startswith("T")
        try:
            self.kill(self.pid, DUMP_SIGNAL)
            if stopped:
                self.kill(self.pid, signal.SIGCONT)  # the pending dump signal runs first
        except ProcessLookupError:
            return ""
        out = b""
        t_end = self.clock() + DUMP_WAIT_S
        quiet_since = None
        while self.clock() < t_end:
            ready, _, _ = select.select([self.dump_fd], [], [], 0.2)
            if ready:
                chunk = os.read(self.dump_fd, 65536)
                if not chunk:
                    break
                out += chunk
                quiet_since = None
            elif out:
                quiet_since = quiet_since or self.clock()
                if self.clock() - quiet_since >= 0.4:
                    break
        if stopped:
            try:
                self.kill(self.pid, signal.SIGSTOP)  # as it was, until the attempt ends
            except ProcessLookupError:
                pass
        return out.decode("utf-8", "replace")

    def _wait_for(self, cond: Callable[[], bool], timeout: float) -> bool:
        t_end = self.clock() + timeout
        while self.clock() < t_end:
            if cond():
                return True
            self.sleep(0.2)
        return cond()

    def coordinate(self, detected: float) -> None:
        """Rank 0's watcher: collect every report, name suspects and victims, record the hang."""
        paths = [self.dir / f"rank{r}.json" for r in range(self.world)]
        self._wait_for(lambda: all(p.exists() for p in paths), COLLECT_S)
        reports = {r: read_json_dict(p) for r, p in enumerate(paths)}
        trigger = read_json_dict(self.dir / "trigger.json") or {}
        summary = hang_report.classify(reports, self.world)
        summary.update(missed=trigger, job_id=self.a.get("job_id"), restart=int(self.a["restart"]),
                       dump="faulthandler (SIGQUIT)", directory=str(self.dir), detected=detected,
                       ended=self.wall())
        prev = read_json_dict(hang_dir(Path(self.a["hangs"]), self.a.get("job_id"), int(self.a["restart"]) - 1)
                          / HANG_SUMMARY) if int(self.a["restart"]) > 0 else None
        repeat = hang_report.repeat_offenders(summary, prev)
        summary["excluded"] = repeat if self.a.get("job_id") else []
        atomic_write_json(self.dir / HANG_SUMMARY, summary)
        self.log(hang_report.describe(summary))
        ev = EventLog(RunPaths.of(self.a["run_dir"]).events, rank=0, job_id=self.a.get("job_id"),
                      restart_count=int(self.a["restart"]), host=self.a.get("host"))
        slim = lambda xs: [{"rank": x["rank"], "host": x["host"], "why": x["why"]} for x in xs]  # noqa: E731
        ev.emit(EventKind.HANG, deadline=trigger.get("what"), deadline_s=trigger.get("seconds"),
                arithmetic=trigger.get("arithmetic"), step=summary["furthest"].get("step"),
                suspects=slim(summary["suspects"]), victims=slim(summary["victims"]),
                unknown=slim(summary["unknown"]), stacks=str(self.dir), dump="faulthandler")
        for host in summary["excluded"]:
            policy.record_failed_node(Path(self.a["run_dir"]), host, "a rank on it hung in two attempts in a row",
                                      job_id=self.a.get("job_id"))
            ev.emit(EventKind.FAILED_NODE, host=host, source="hang_twice")
        names = ", ".join(f"rank {s['rank']} on {s['host']}" for s in summary["suspects"]) or "none"
        ev.emit(EventKind.STOP, reason="hang", code=1,
                detail=f"{trigger.get('what')} deadline missed ({trigger.get('arithmetic')}); suspects: {names}; "
                       f"stacks in {self.dir}")
        ev.emit(EventKind.EXIT, reason="hang", code=1, step=summary["furthest"].get("step"))

    def end_rank(self) -> None:
        """End the attempt: the rank dies; srun, the launcher or the harness take the rest down."""
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                self.kill(self.pid, sig)
            except ProcessLookupError:
                return


def main(argv: Optional[list] = None) -> int:
    args = json.loads((argv if argv is not None else sys.argv[1:])[0])
    for s in IGNORED:  # Slurm signals every process of the step; the rank decides, not its watcher
        signal.signal(s, signal.SIG_IGN)
    w = Watcher(args, log=lambda m: print(m, flush=True))
    return w.run()


if __name__ == "__main__":
    sys.exit(main())
