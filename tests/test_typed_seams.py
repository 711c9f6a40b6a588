"""The typed seams of the rank: the start decision is a typed value decided without torch or a process group
(recovery/start.py), the checkpointer holds its asynchronous saves as a field, and the training loop names the
types it is handed."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import typing
from pathlib import Path

from recovery import exit_codes, lock
from recovery.commit import commit, prepare_staging
from recovery.policy import Decision
from recovery.resume import Resume
from recovery.start import Start, decide_start
from recovery.storage import LocalStorage

REPO = Path(__file__).resolve().parent.parent


def _job(tmp_path: Path):
    from launch.compose import compose_job

    job = compose_job(["model=tiny", "cluster=local", f"run.dir={tmp_path}", "run.name=seams"])
    return job, job.paths_at(tmp_path)


def _decide(tmp_path: Path, env: dict | None = None, restart: int = 0) -> Start:
    job, paths = _job(tmp_path)
    return decide_start(paths, job, restart=restart, job_id=None, env=env or {}, storage=LocalStorage(), world=1,
                        layout={}, inventories=None)


def _committed(root: Path, step: int, identity: dict) -> Path:
    """A committed, verified checkpoint directory without torch: two files through the commit protocol."""
    d = prepare_staging(root, step)
    (d / "__0_0.distcp").write_bytes(f"step {step} ".encode() * 500)
    (d / "common.pt").write_bytes(b"common" + str(step).encode())
    return commit(root, step, {"step": step, "model": identity["model"]}, keep=3, run=identity).path


def test_no_checkpoint_starts_from_scratch_and_holds_the_lock(tmp_path):
    start = _decide(tmp_path)
    try:
        assert isinstance(start.decision, Decision) and start.ok
        assert (start.decision.ok, start.decision.reason, start.decision.code) == (True, "start", exit_codes.EXIT_COMPLETED)
        assert start.resume.path is None and start.resume.step is None
        assert start.identity["name"] == "seams" and start.run_lock is not None
        assert (tmp_path / "run.lock").exists()
    finally:
        start.run_lock.release()


def test_a_committed_checkpoint_is_resumed_at_its_step(tmp_path):
    first = _decide(tmp_path)
    first.run_lock.release()
    path = _committed(tmp_path / "checkpoints", 10, first.identity)
    start = _decide(tmp_path, restart=1)
    try:
        assert start.ok and start.decision.reason == "resume"
        assert start.resume.step == 10 and Path(start.resume.path) == path
    finally:
        start.run_lock.release()


def test_a_held_run_lock_refuses_with_its_final_code(tmp_path):
    _, paths = _job(tmp_path)
    holder = lock.acquire(paths.lock, lock.me_from_env({}))  # this live process holds the run
    try:
        start = _decide(tmp_path)
        assert not start.ok and start.run_lock is None
        assert start.decision.reason == "run_locked" and start.decision.code == exit_codes.EXIT_RUN_LOCKED
        assert exit_codes.code_name(start.decision.code) == "run_locked" and f"pid {os.getpid()}" in start.decision.detail
    finally:
        holder.release()


def test_the_start_survives_the_broadcast_pickle(tmp_path):
    start = _decide(tmp_path)
    start.run_lock.release()
    sent = Start(start.resume, start.decision, start.notices, start.identity, start.local)
    back = pickle.loads(pickle.dumps(sent))
    assert back == sent and back.decision == start.decision and back.ok
    refused = Start(Resume(None, None), Decision(False, "run_locked", exit_codes.EXIT_RUN_LOCKED, "held"))
    assert pickle.loads(pickle.dumps(refused)).decision.code == exit_codes.EXIT_RUN_LOCKED


def test_the_start_decision_imports_neither_torch_nor_train():
    code = ("import sys, recovery.start; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'train')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_checkpointer_holds_its_async_saves_as_a_field(tmp_path):
    from launch import dist_env
    from recovery.events import EventLog
    from recovery.signals import StopFlag
    from train.async_ckpt import AsyncSaves
    from train.checkpointer import Checkpointer
    from train.context import RankContext

    assert not issubclass(Checkpointer, AsyncSaves)
    job, paths = _job(tmp_path)
    ctx = RankContext(job=job, paths=paths, dist=dist_env.DistEnv(0, 1, 0, "127.0.0.1", 1), env={}, restart=0,
                      flag=StopFlag(), events=EventLog(paths.events, rank=0))
    ckpt = Checkpointer(ctx, parts=None)
    assert isinstance(ckpt.async_saves, AsyncSaves) and ckpt.async_saves.ckpt is ckpt
    assert ckpt.pending is None
    ckpt.pending = "in flight"  # the property is the field's
    assert ckpt.async_saves.pending == "in flight"


def test_the_async_module_does_not_import_the_checkpointer_at_run_time():
    import ast

    tree = ast.parse((REPO / "train" / "async_ckpt.py").read_text())
    guarded = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for n in ast.walk(node)}
    runtime = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and id(n) not in guarded
               and (n.module or "").startswith("train.checkpointer")]
    assert runtime == []


def test_run_loop_names_the_rank_context_and_the_checkpointer():
    from train.checkpointer import Checkpointer
    from train.context import RankContext
    from train.train_loop import run_loop

    hints = typing.get_type_hints(run_loop)
    assert hints["ctx"] is RankContext and hints["ckpt"] is Checkpointer
