"""Rank processes forked from a warm interpreter, for the training tests' harnesses (not the product's launcher).

Every rank of a test run is ``python -m train.worker RUN_DIR``; a fresh interpreter spends about 7 CPU-seconds
importing torch and Megatron-Core before the rank does anything, and the suite starts hundreds of ranks on a
2-core machine. Here one helper process per test process (per set of the environment variables that take
effect when torch is imported) imports them once; each rank is then a fork of it that becomes
``python -m <module> <args>`` exactly as a fresh interpreter would run it: its own session, working directory,
environment, ``sys.argv`` and ``sys.path[0]``, its output appended to the rank's log, the module run as
``__main__`` (``runpy``), and a normal interpreter exit (``SystemExit`` code, ``atexit``, non-daemon threads).
The rank is still the real worker with real Megatron-Core training over gloo; only the start-up differs.

:func:`rank_popen` is the ``popen`` the harnesses give :class:`launch.local.Ranks`. It forks only what it can
run the same way (``-m`` of a module, output to a file, the same interpreter and the same import-time
variables as a helper it keeps); anything else, and everything when ``SLURMTRON_TEST_COLD_RANKS=1``, goes to
:class:`subprocess.Popen`. The product's own launches (``launch/pretrain.py``, ``launch/preflight.py``, the
Slurm scenarios) never come here.

As a script, this file is the helper: ``python tests/warm_ranks.py SOCKET`` (the client starts it).
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

COLD_ENV = "SLURMTRON_TEST_COLD_RANKS"
# variables read when torch/OpenMP/Python start (not later): a helper serves ranks whose values equal its own
IMPORT_TIME_PREFIXES = ("PYTHON", "OMP_", "KMP_", "GOMP_", "MKL_", "TORCH", "PYTORCH_", "CUDA_", "NCCL_", "LD_")
# the modules a rank imports, heaviest first (train/'s own modules import torch and Megatron-Core at the top)
PRELOAD = ("torch", "torch.distributed", "megatron.core", "train.distributed", "train.train_loop",
           "train.checkpointer", "train.megatron_ckpt", "train.megatron_model", "train.local_ckpt",
           "train.async_ckpt", "train.data", "launch.compose")
MODULES = ("train.worker",)  # what a helper runs
READY = b"ready\n"


def import_time_env(env: Dict[str, str]) -> Tuple[Tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES)))


# ---- the helper (a separate process) -------------------------------------------------------------------------

def serve(path: str) -> Optional[dict]:
    """Accept rank requests on the socket ``path`` until the client goes away; fork one child per request. In the
    child this returns the request (with the output descriptor); in the helper it returns None at the end."""
    sys.path[0] = os.getcwd()  # a script's directory is sys.path[0]; ``python -m`` has its working directory
    for name in PRELOAD:
        __import__(name)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    srv.listen(64)
    os.write(1, READY)
    parent = os.getppid()
    waiting: Dict[int, socket.socket] = {}
    while os.getppid() == parent:
        ready, _w, _x = select.select([srv], [], [], 0.05)
        if ready:
            conn, _addr = srv.accept()
            msg, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 1)
            job = json.loads(msg)
            started_r, started_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                if job.get("session"):
                    os.setsid()  # before the client hears the pid: it may signal the session at once
                os.write(started_w, b"x")
                os.close(started_w)
                os.close(started_r)
                srv.close()
                conn.close()
                for c in waiting.values():
                    c.close()
                job["fd"] = fds[0]
                return job
            os.close(fds[0])
            os.close(started_w)
            os.read(started_r, 1)  # the child is in its own session (or gone: then EOF)
            os.close(started_r)
            conn.send(json.dumps({"pid": pid}).encode())
            waiting[pid] = conn
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.send(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode())
                except OSError:
                    pass
                conn.close()
    return None


def become(job: dict) -> None:
    """In the forked child (already in its own session when asked for): be ``python -m <module> <args>`` with
    ``job``'s directory, environment and output; returns when the module has run (the interpreter then exits as
    usual)."""
    import runpy

    os.chdir(job["cwd"])
    fd = job["fd"]
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(job["env"])
    sys.argv = [job["module"], *job["args"]]
    sys.path[0] = job["cwd"]
    runpy.run_module(job["module"], run_name="__main__", alter_sys=True)


# ---- the client (the test process) -----------------------------------------------------------------------------

class WarmProc:
    """What :class:`launch.local.Ranks` needs of a ``Popen``: ``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``,
    ``returncode``; the exit code comes from the helper, which is the child's parent."""

    def __init__(self, conn: socket.socket, pid: int, args: Sequence[str]) -> None:
        self.conn, self.pid, self.args = conn, pid, list(args)
        self.returncode: Optional[int] = None
        self.stdout = None
        self._lock = threading.Lock()

    def _take(self, timeout: Optional[float]) -> Optional[int]:
        with self._lock:
            if self.returncode is not None:
                return self.returncode
            ready, _w, _x = select.select([self.conn], [], [], timeout)
            if not ready:
                return None
            msg = self.conn.recv(4096)
            # the helper gone without a word (it never is while its client lives): the rank's fate is unknown
            self.returncode = int(json.loads(msg)["code"]) if msg else -signal.SIGKILL
            self.conn.close()
            return self.returncode

    def poll(self) -> Optional[int]:
        return self._take(0)

    def wait(self, timeout: Optional[float] = None) -> int:
        code = self._take(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Helper:
    """One helper process (started once, ready when its imports are done) and its socket."""

    def __init__(self, env: Dict[str, str], cwd: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="slurmtron-warm-")
        self.path = os.path.join(self.dir, "sock")
        self.log = open(os.path.join(self.dir, "helper.log"), "ab")
        self.proc = subprocess.Popen([sys.executable, __file__, self.path], cwd=cwd, env=env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self.log)
        if self.proc.stdout.readline() != READY:  # the imports failed: its log says why
            raise RuntimeError(f"the warm-rank helper did not start; see {self.log.name}")

    def spawn(self, module: str, args: Sequence[str], env: Dict[str, str], cwd: str, out: Any,
              session: bool) -> WarmProc:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(self.path)
        job = {"module": module, "args": list(args), "env": dict(env), "cwd": str(cwd), "session": session}
        socket.send_fds(conn, [json.dumps(job).encode()], [out.fileno()])
        pid = int(json.loads(conn.recv(4096))["pid"])
        return WarmProc(conn, pid, [sys.executable, "-m", module, *args])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        for name in ("sock", "helper.log"):
            try:
                os.unlink(os.path.join(self.dir, name))
            except OSError:
                pass
        try:
            os.rmdir(self.dir)
        except OSError:
            pass


class WarmRanks:
    """The helpers of this test process, one per set of import-time variables, started on first use."""

    def __init__(self) -> None:
        self.helpers: Dict[tuple, Helper] = {}
        self.lock = threading.Lock()

    def popen(self, argv: Sequence[str], *, env: Optional[Dict[str, str]] = None, cwd: Any = None, stdout: Any = None,
              stderr: Any = None, start_new_session: bool = False, **kw: Any) -> Any:
        env = dict(os.environ if env is None else env)
        warm = (not env.get(COLD_ENV) and not kw and len(argv) >= 3 and argv[0] == sys.executable
                and argv[1] == "-m" and argv[2] in MODULES and stderr == subprocess.STDOUT
                and hasattr(stdout, "fileno") and cwd is not None)
        if not warm:
            return subprocess.Popen(list(argv), env=env, cwd=cwd, stdout=stdout, stderr=stderr,
                                    start_new_session=start_new_session, **kw)
        key = import_time_env(env)
        with self.lock:
            helper = self.helpers.get(key)
            if helper is None:
                helper = self.helpers[key] = Helper(env, str(cwd))
        return helper.spawn(argv[2], argv[3:], env, str(cwd), stdout, start_new_session)

    def close(self) -> None:
        for helper in self.helpers.values():
            helper.close()
        self.helpers.clear()


_WARM = WarmRanks()
atexit.register(_WARM.close)


def rank_popen() -> Any:
    """The ``popen`` for :class:`launch.local.Ranks` in the test harnesses."""
    return _WARM.popen


if __name__ == "__main__":
    _job = serve(sys.argv[1])
    if _job is None:
        sys.exit(0)
    become(_job)
