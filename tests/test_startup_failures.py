"""A rank that cannot start (an import, the process group join) is a decision, not a loop; attempts are counted once.

The rule (:func:`recovery.policy.startup_decision`) on records written by :mod:`recovery.startup_failures`, the one
definition of an attempt (:mod:`launch.attempts`), and the real thing: ``launch/pretrain.py`` on ``cluster=local``
with Megatron-Core unimportable on every rank (a ``PYTHONPATH`` directory whose ``megatron.core`` raises
``ModuleNotFoundError``; the product's launches start cold ranks, so the import really fails), then the same command
with the environment fixed, twice.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from launch import attempts
from launch.paths import RunPaths
from recovery import policy
from recovery.exit_codes import EXIT_ZERO_PROGRESS
from recovery.startup_failures import record_startup_failure, startup_failures

REPO = Path(__file__).resolve().parent.parent
ERROR = "ModuleNotFoundError: No module named 'megatron.core'"


def _fail(run_dir: Path, attempt: int, rank: int = 0, *, job_id=None, restart=None, host="n1", error=ERROR) -> None:
    record_startup_failure(run_dir, job_id=job_id, attempt=attempt, restart_count=attempt if restart is None else restart,
                           rank=rank, host=host, error=error, phase="start-up", traceback="Traceback ...")


def _env(attempt: int, restart: int, **more) -> dict:
    return {attempts.ATTEMPT_ENV: str(attempt), "SLURMTRON_RESTART_COUNT": str(restart), **more}


TRAINING = SimpleNamespace(zero_progress_restarts=2, max_restarts=20)


def test_the_start_up_rule_stops_a_chain_of_start_up_failures_only(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    assert policy.startup_decision(run, _env(0, 0), TRAINING).ok  # nothing recorded
    _fail(run, 0, rank=0)
    _fail(run, 0, rank=1, host="n2")  # two ranks of one attempt, at once: two files
    assert policy.startup_decision(run, _env(1, 1), TRAINING).ok  # one failure < 2
    _fail(run, 1, rank=1)
    dec = policy.startup_decision(run, _env(2, 2), TRAINING)
    assert (dec.ok, dec.reason, dec.code) == (False, "zero_progress", EXIT_ZERO_PROGRESS)
    assert dec.detail.startswith(f"megatron is not importable on nodes n1, n2: {ERROR} (the last 2 attempts")
    assert "\n" not in dec.detail
    # a fresh launch (restart count 0) is a new chain: the user who fixed the environment is not refused
    assert policy.startup_decision(run, _env(2, 0), TRAINING).ok
    assert policy.startup_decision(run, _env(3, 1), TRAINING).ok  # attempt 2 started: the chain made progress
    # off with zero_progress_restarts <= 0
    assert policy.startup_decision(run, _env(2, 2), SimpleNamespace(zero_progress_restarts=0)).ok


def test_on_slurm_the_rule_reads_the_same_jobs_attempts(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    slurm = lambda restart, job="77": {"SLURM_JOB_ID": job, "SLURM_RESTART_COUNT": str(restart)}  # noqa: E731
    _fail(run, 0, job_id="77", error="ImportError: libcudart.so.12: cannot open shared object file")
    _fail(run, 1, job_id="77", error="ImportError: libcudart.so.12: cannot open shared object file")
    dec = policy.startup_decision(run, slurm(2), TRAINING)
    assert not dec.ok and dec.detail.startswith("the ranks could not start on node n1: ImportError: libcudart")
    assert policy.startup_decision(run, slurm(2, job="78"), TRAINING).ok  # another job's attempts are not these
    assert set(startup_failures(run)) == {("77", 0), ("77", 1)}


def test_a_refusal_on_a_node_whose_rank_0_was_killed_first_is_still_final_for_the_requeue_judge(tmp_path, capsys):
    """The ranks reach the same verdict, but the first to exit 3 gets its peers killed (srun --kill-on-bad-exit),
    rank 0 perhaps before it decided (seen on the real cluster: the job was requeued and the chain of start-up
    failures broken). The first rank of every node records the final stop, so the requeue judge stops."""
    from recovery.crash import attempt_events, crashed
    from recovery.events import read_events
    from train.worker import _refuse_after_startup_failures

    run = tmp_path / "run"
    run.mkdir()
    paths = RunPaths.of(run)
    _fail(run, 0, job_id="77")
    _fail(run, 1, job_id="77")
    slurm = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "2", "SLURM_PROCID": "9", "SLURM_LOCALID": "1"}
    assert _refuse_after_startup_failures(paths, slurm, TRAINING) == EXIT_ZERO_PROGRESS
    assert read_events(paths.events) == []  # not the first rank of its node: the line only
    first_of_node = dict(slurm, SLURM_PROCID="8", SLURM_LOCALID="0")
    assert _refuse_after_startup_failures(paths, first_of_node, TRAINING) == EXIT_ZERO_PROGRESS
    mine = attempt_events(read_events(paths.events), "77", 2)
    assert [(e["event"], e["rank"]) for e in mine] == [("stop", 8)]
    requeue, why = crashed(mine)  # rank 0 was killed before it decided: no exit event, and still no requeue
    assert not requeue and "stopped for good (zero_progress)" in why
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(line.startswith("slurmtron: refused to start: megatron is not importable") for
                                   line in lines)


def test_one_definition_of_the_attempts(tmp_path):
    events = [
        {"event": "job_start", "rank": 0, "job_id": None, "restart_count": 0, "attempt": 4},
        {"event": "job_start", "rank": 1, "job_id": None, "restart_count": 0, "attempt": 4},  # rank 0's counts
        {"event": "startup_failed", "rank": 1, "job_id": None, "restart_count": 1, "attempt": 5},
        {"event": "stop", "rank": 0, "job_id": None, "restart_count": 2, "attempt": 6, "reason": "zero_progress"},
        {"event": "iteration", "rank": 0, "job_id": None, "restart_count": 0, "attempt": 7},  # not an attempt's mark
        {"event": "job_start", "rank": 0, "job_id": "9001", "restart_count": 1},  # Slurm: the restart count
        {"event": "exit", "rank": 0, "job_id": "9001", "restart_count": 1, "reason": "error"},
    ]
    logs = ["local_0_rank0.out", "local_4_rank1.out", "9001_0.out", "9001_batch.out"]
    assert attempts.attempt_keys(events, logs) == {("local", 0), ("local", 4), ("local", 5), ("local", 6),
                                                   ("9001", 1)}
    # an event log written before attempts were numbered: each local launch restarted at 0, each job_start counts
    legacy = [{"event": "job_start", "rank": 0, "job_id": None, "restart_count": 0},
              {"event": "exit", "rank": 0, "job_id": None, "restart_count": 0},
              {"event": "job_start", "rank": 0, "job_id": None, "restart_count": 0}]
    assert attempts.attempt_count(legacy, ["local_0_rank0.out"]) == 2
    # a new launch starts one past every attempt the run recorded anywhere
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    assert attempts.next_attempt(run) == 0
    (run / "logs" / "local_2_rank0.out").write_text("x")
    assert attempts.next_attempt(run, events) == 7
    assert attempts.next_attempt(run, [], [("local", 9)]) == 10
    assert attempts.next_attempt(run) == 3


def _hashes(logs: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(logs.iterdir())}


def _pretrain(overrides: list, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "launch" / "pretrain.py"), *overrides], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def _no_slurm(argv, **_kw):
    raise AssertionError(f"a cluster=local run asked Slurm: {argv}")


def test_unimportable_megatron_stops_with_one_line_and_a_relaunch_numbers_after_it(tmp_path):
    """Every rank's ``import megatron.core`` fails: 2 attempts fail at start-up (one line per rank, the traceback in
    the record), the third is refused by the start-up rule with one line and exit 3. The same command with the
    environment fixed is not refused (a new chain), trains as attempt 3, and a launch of the completed run with a
    higher target is attempt 4; no earlier attempt's log changes by a byte, and the launcher, status and the report count alike."""
    from analysis.report import main as report_main
    from launch import run_state

    broken = tmp_path / "broken_site"
    (broken / "megatron" / "core").mkdir(parents=True)
    (broken / "megatron" / "__init__.py").write_text("")
    (broken / "megatron" / "core" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'megatron.core'\", name='megatron.core')\n")
    run_dir = tmp_path / "run"
    overrides = ["cluster=local", "cluster.gpus_per_node=2", "parallelism=tp2", "training.train_iters=2",
                 "training.zero_progress_restarts=2", f"run.dir={run_dir}", "run.name=nomegatron"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "SLURMTRON_"))}
    env = {**clean, "PYTHONPATH": os.pathsep.join([str(broken), *filter(None, [clean.get("PYTHONPATH")])])}

    first = _pretrain(overrides, tmp_path, env)
    said = first.stdout + first.stderr
    assert first.returncode == EXIT_ZERO_PROGRESS, said[-4000:]
    assert "Traceback" not in said and "File \"" not in said, said[-4000:]
    stop_line = [line for line in said.splitlines() if "is not importable on node" in line]
    assert stop_line == [f"slurmtron: refused to start: megatron is not importable on node {os.uname().nodename}: "
                         f"{ERROR} (the last 2 attempts failed before their first step, "
                         f"training.zero_progress_restarts=2; the records are in {run_dir / 'startup'}; fix the "
                         f"environment and launch again) (exit 3; final: not relaunched or requeued)"], said[-4000:]
    # the terminal shows the last rank: one line per failed attempt, no more
    assert [line.split(" (attempt")[0] for line in said.splitlines() if "could not start" in line] == \
        [f"rank 1: could not start on {os.uname().nodename} (start-up): {ERROR}"] * 2
    launcher = [line for line in said.splitlines() if line.startswith("launcher: ")]
    assert len(launcher) == 4 and launcher[-1]  # the first attempt's start, each relaunch, the end.startswith("launcher: run nomegatron stopped: zero_progress (exit 3)")
    assert "and 3 attempt(s) (attempts 0-2; 3 in the run)" in launcher[-1]
    assert sorted(startup_failures(run_dir)) == [("local", 0), ("local", 1)]
    record = json.loads(RunPaths.of(run_dir).startup_failure(None, 1, 0).read_text())
    assert record["error"] == ERROR and "Traceback" in record["traceback"] and record["restart_count"] == 1
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    stops = [(e["reason"], e.get("attempt")) for e in events if e["event"] == "stop" and e["rank"] == 0]
    assert stops == [("crash", 0), ("crash", 1), ("zero_progress", 2)]
    logs = run_dir / "logs"
    assert sorted(_hashes(logs)) == [f"local_{a}_rank{r}.out" for a in range(3) for r in range(2)]
    before = _hashes(logs)

    second = _pretrain(overrides, tmp_path, clean)  # the environment fixed: a fresh launch, a new chain
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    assert "attempt 3: starting 2 rank(s)" in second.stdout
    assert "and 1 attempt(s) (attempt 3; 4 in the run)" in second.stdout
    again = _pretrain(overrides, tmp_path, clean)  # complete: refused before any rank starts, nothing written
    assert again.returncode == 0 and "no rank started" in again.stderr, (again.stdout + again.stderr)[-4000:]
    third = _pretrain([*overrides, "training.train_iters=3"], tmp_path, clean)  # the completed run trains on
    assert third.returncode == 0, (third.stdout + third.stderr)[-4000:]
    assert "(attempt 4; 5 in the run)" in third.stdout
    after = _hashes(logs)
    assert {k: after[k] for k in before} == before  # every earlier attempt's log byte-identical
    assert sorted(set(after) - set(before)) == [f"local_{a}_rank{r}.out" for a in (3, 4) for r in range(2)]

    st = run_state.gather(run_dir, runner=_no_slurm)
    out = tmp_path / "report"
    assert report_main([str(run_dir), "--out", str(out)]) == 0
    [summary] = json.loads((out / "summary.json").read_text())["runs"].values()
    assert st.attempts == summary["attempts"] == 5
    assert st.state == "completed" and st.interruptions == {"crash": 2, "zero_progress": 1}
    assert summary["counts_by_cause"] == {"crash": 2, "zero_progress": 1}


def test_the_teardown_of_a_start_that_could_not_import_megatron_imports_nothing(tmp_path):
    """A start-up that failed importing Megatron-Core tears down without importing it again (that second error
    escaped as a traceback chain when a stop signal had also arrived: srun ending the peers of a failed rank)."""
    site = tmp_path / "site" / "megatron" / "core"
    site.mkdir(parents=True)
    (site.parent / "__init__.py").write_text("")
    (site / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'megatron.core'\", "
                                      "name='megatron.core')\n")
    code = ("from train.distributed import shutdown_distributed\nshutdown_distributed()\n"
            "from types import SimpleNamespace as N\nfrom train.worker import _failed_to_start\n"
            "ctx = N(decided=False, flag=N(received_at=1.0))\n"
            "print(_failed_to_start(ctx, ModuleNotFoundError('x')), _failed_to_start(ctx, RuntimeError('x')))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(REPO)]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.split() == ["True", "False"]  # an import error is a start-up failure, signal or not
