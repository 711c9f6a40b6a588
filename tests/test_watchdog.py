"""The hang watchdog, the NaN-guard policy checks and the straggler arithmetic, without torch.

The watcher itself runs for real: a small Python child (no torch) plays a rank that starts its
watcher, sends heartbeats and then hangs; the watcher must dump its stacks, name it, record
the ``hang`` events and kill it, within the deadline plus a bounded margin.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from launch.check_watch import problems
from launch.compose import compose_job
from recovery import crash
from recovery.events import read_events
from recovery.hang_report import Limits, Watch, classify, collective_frame, main_thread_frames, repeat_offenders
from train.stragglers import Regression, find_stragglers

REPO = Path(__file__).resolve().parent.parent

VICTIM = '''Thread 0x00007f0000000002 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0000000001 (most recent call first):
  File "/site-packages/torch/distributed/distributed_c10d.py", line 2935 in all_reduce
  File "/repo/train/train_loop.py", line 250 in agree_stop
  File "/repo/train/worker.py", line 400 in _train
  File "<frozen runpy>", line 88 in _run_code
  File "/repo/train/worker.py", line 1 in <module>
'''
SUSPECT = '''Thread 0x00007f0000000003 (most recent call first):
  File "/repo/train/worker.py", line 104 in __getitem__
  File "/repo/train/data.py", line 90 in step_batches
  File "/repo/train/worker.py", line 1 in <module>
'''


def test_watch_deadlines_follow_the_phases_with_their_arithmetic():
    w = Watch(Limits(startup_s=100, step_factor=5, step_floor_s=2, save_factor=3, save_floor_s=4), started=0.0)
    d = w.deadline()
    assert (d.what, d.at) == ("startup", 100.0) and "training.watchdog.startup_s" in d.arithmetic
    w.beat(1, "train", 0, 0.0, 10.0)
    assert w.deadline().at == 100.0  # start-up runs to the first finished step
    w.beat(2, "step", 1, 3.0, 13.0)  # first step: its own time
    w.beat(3, "step", 2, 1.0, 14.0)
    w.beat(4, "step", 3, 1.0, 15.0)
    d = w.deadline()
    assert d.what == "step" and d.seconds == pytest.approx(5.0)  # median(3, 1, 1) = 1 -> 5 x 1 > floor 2
    assert "5 x median step 1.000 s over 3 step(s)" in d.arithmetic and d.at == pytest.approx(20.0)
    w.beat(5, "save", 3, 0.0, 15.5)
    d = w.deadline()
    assert d.what == "save" and d.seconds == 100.0  # no save measured yet
    w.beat(6, "saved", 3, 2.0, 17.5)
    w.beat(7, "save", 6, 0.0, 30.0)
    assert w.deadline().seconds == pytest.approx(6.0)  # max(3 x 2.0, 4)
    w.beat(8, "saved", 6, 0.5, 30.5)
    w.beat(9, "step", 7, 1.0, 31.5)
    assert len(w.step_intervals) == 4  # the interval across the save is not a step sample


def test_classify_names_the_rank_outside_any_collective_and_the_stopped_one():
    rep = {0: {"seq": 8, "phase": "step", "step": 4, "host": "n1", "proc_state": "S", "stacks": VICTIM},
           1: {"seq": 8, "phase": "step", "step": 4, "host": "n2", "proc_state": "S", "stacks": SUSPECT}}
    out = classify(rep, 2)
    assert [s["rank"] for s in out["suspects"]] == [1] and out["suspects"][0]["host"] == "n2"
    assert "__getitem__" in out["suspects"][0]["why"]
    assert [v["rank"] for v in out["victims"]] == [0] and "all_reduce" in out["victims"][0]["why"]
    rep[1]["stacks"] = VICTIM
    rep[1]["proc_state"] = "T"
    out = classify(rep, 2)
    assert [s["rank"] for s in out["suspects"]] == [1] and "stopped" in out["suspects"][0]["why"]
    rep[1]["proc_state"] = "S"
    rep[1]["seq"] = 7
    out = classify(rep, 2)
    assert [s["rank"] for s in out["suspects"]] == [1] and "did not reach the last heartbeat" in out["suspects"][0]["why"]
    out = classify({0: rep[0]}, 3)
    assert [u["rank"] for u in out["unknown"]] == [1, 2]


def test_main_thread_is_the_one_running_the_module():
    frames = main_thread_frames(VICTIM)
    assert frames[0][2] == "all_reduce" and collective_frame(frames).startswith("all_reduce")
    assert collective_frame(main_thread_frames(SUSPECT)) is None


def test_a_host_is_a_repeat_offender_only_when_it_was_a_suspect_in_the_previous_hang_too():
    cur = {"suspects": [{"rank": 1, "host": "n2"}]}
    assert repeat_offenders(cur, None) == []
    assert repeat_offenders(cur, {"suspects": [{"rank": 3, "host": "n4"}]}) == []
    assert repeat_offenders(cur, {"suspects": [{"rank": 0, "host": "n2"}]}) == ["n2"]


def test_stragglers_against_the_low_median_and_a_sustained_regression():
    med, slow = find_stragglers([1.0, 1.0, 1.5, 1.05], 0.2)
    assert med == 1.0 and [r for r, _ in slow] == [2]
    assert find_stragglers([1.0, 1.3], 0.2)[1][0][0] == 1  # two ranks: the faster one is the median
    reg = Regression(threshold=0.2, intervals=2)
    assert [reg.update(x) for x in (1.0, 1.0, 1.1, 1.3)] == [None, None, None, None]
    ev = reg.update(1.4)
    assert ev is not None and ev["baseline_s"] == 1.0 and ev["intervals"] == 2
    assert reg.update(1.5) is None  # one event per episode
    reg.update(1.0)
    reg.update(1.4)
    assert reg.update(1.4) is not None  # re-armed after recovering


def _job(*over):
    return compose_job(["cluster=slurm_local", "run.time_limit_min=10", *over])


def test_check_refuses_pointless_step_deadlines_with_the_arithmetic():
    assert problems(_job()) == []
    p = {x.field: x for x in problems(_job("training.watchdog.step_floor_s=2000", "run.time_limit_min=120"))}
    assert "process-group timeout 1800 s" in p["training.watchdog.step_floor_s"].arithmetic
    p = problems(_job("training.watchdog.step_floor_s=500", "training.signal_lead_time_s=120"))
    assert len(p) == 1 and "10 * 60 - signal_lead_time_s 120 = 480" in p[0].arithmetic
    from launch.check import check

    found = {x.field: x for x in check(_job("training.nan_guard.on_nan=rollbak", "training.watchdog.step_factor=1",
                                            "training.nan_guard.skip_batches=-1", "training.stragglers.interval=-1"))}
    assert set(found) == {"training.nan_guard.on_nan", "training.watchdog.step_factor",
                          "training.nan_guard.skip_batches", "training.stragglers.interval"}
    assert "did you mean training.nan_guard.on_nan=rollback?" in found["training.nan_guard.on_nan"].fix


def test_a_hung_attempt_is_requeued_after_a_crash_of_the_step():
    events = [{"event": "hang"}, {"event": "stop", "reason": "hang", "detail": "step deadline missed"},
              {"event": "exit", "reason": "hang", "code": 1}]
    again, why = crash.crashed(events)
    assert again and "hung" in why
    assert not crash.crashed([{"event": "stop", "reason": "nan"}, {"event": "exit", "reason": "nan", "code": 5}])[0]


CHILD = textwrap.dedent('''
    import sys, time
    from pathlib import Path
    from recovery.hang_report import Limits
    from recovery.watchdog import Heartbeat
    run = Path(sys.argv[1])
    hb = Heartbeat.start(run, run / "hangs", Limits(startup_s=30, step_factor=5, step_floor_s=1.5,
                         save_factor=3, save_floor_s=5), rank=0, world=1, job_id=None, restart=0, host="testhost")
    hb.beat("train")
    for i in range(1, 4):
        time.sleep(0.05)
        hb.beat("step", i, 0.05)
    print("HUNG AT", time.time(), flush=True)
    def stuck_reading_a_file():
        time.sleep(60)
    stuck_reading_a_file()
''')


def test_the_watcher_dumps_names_records_and_kills_a_hung_rank(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(CHILD)
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == -9, proc.stdout + proc.stderr  # killed by its watcher
    hung_at = float(proc.stdout.split("HUNG AT")[1].split()[0])
    d = tmp_path / "hangs" / "local_0"
    summary = json.loads((d / "summary.json").read_text())
    latency = summary["ended"] - hung_at
    assert 1.5 <= latency < 1.5 + 6.0, latency  # the deadline plus a bounded margin (poll, dump, collect)
    assert [s["rank"] for s in summary["suspects"]] == [0] and summary["suspects"][0]["host"] == "testhost"
    assert "stuck_reading_a_file" in (d / "rank0.stacks.txt").read_text()
    kinds = [(e["event"], e.get("reason")) for e in read_events(tmp_path / "events.jsonl")]
    assert kinds == [("hang", None), ("stop", "hang"), ("exit", "hang")]
    assert time.time() - t0 < 30


SHIM_WAIT = '''Current thread 0x00007f0000000001 (most recent call first):
  File "/repo/train/cpu_shim.py", line 45 in __torch_function__
  File "/site-packages/megatron/core/distributed/param_and_grad_buffer.py", line 400 in finish_grad_sync
  File "/repo/train/train_loop.py", line 250 in train_step
  File "<frozen runpy>", line 88 in _run_code
  File "/repo/train/worker.py", line 1 in <module>
'''


def test_only_the_ranks_that_did_not_reach_the_collective_are_suspects():
    """Rank 1 SIGSTOPped: rank 3, its data-parallel peer, waits in the gradient all-reduce under the CPU shim's
    frame (the wait is C++, no torch.distributed frame); it is a victim, the suspect set is exactly {1}."""
    rep = {0: {"seq": 8, "phase": "step", "step": 4, "host": "n1", "proc_state": "S", "stacks": VICTIM},
           1: {"seq": 8, "phase": "step", "step": 4, "host": "n1", "proc_state": "T", "stacks": VICTIM},
           2: {"seq": 8, "phase": "step", "step": 4, "host": "n2", "proc_state": "S", "stacks": VICTIM},
           3: {"seq": 8, "phase": "step", "step": 4, "host": "n2", "proc_state": "S", "stacks": SHIM_WAIT}}
    out = classify(rep, 4)
    assert [s["rank"] for s in out["suspects"]] == [1]
    assert [v["rank"] for v in out["victims"]] == [0, 2, 3]
    assert "waiting for rank 1" in out["victims"][2]["why"] and "cpu_shim" in out["victims"][2]["why"]
    # a rank behind the last heartbeat is as sure a suspect as a stopped one
    rep[1]["proc_state"], rep[1]["seq"] = "S", 7
    assert [s["rank"] for s in classify(rep, 4)["suspects"]] == [1]
    # with no sure suspect, the rank outside every collective is the one to look at (a data-path hang)
    rep[1]["seq"] = 8
    assert [s["rank"] for s in classify(rep, 4)["suspects"]] == [3]
