"""training.on_save_failure and the stuck writer on real Megatron-Core training (CPU, gloo, one rank).

An injected EIO in the commit of a periodic save (``SLURMTRON_TEST_SAVE_EIO=K``: the first K commits of the
attempt fail) under each policy: ``stop`` ends the attempt with storage_error (exit 7, final) at the first one,
``retry`` (asynchronous saves: the same judgement) goes on after the first and stops at the second, ``skip``
goes on and completes. A writer made to hang (``SLURMTRON_TEST_ASYNC_HANG_AT``: the forked writer of step 2
sleeps) is abandoned at its deadline while training goes on; its ``iter_2.tmp`` is never committed or loaded.
"""
from __future__ import annotations

import pytest

from trainutil import train
from launch.paths import RunPaths
from recovery.policy import EXIT_STORAGE, REFUSAL_CODES
from recovery.resume import find_latest_verified

pytestmark = pytest.mark.training

ITERS = 8
BASE = ["parallelism=tp1", f"training.train_iters={ITERS}", "training.checkpoint_interval=2"]


def of(events: list, kind: str) -> list:
    return [e for e in events if e["event"] == kind]


def test_stop_ends_at_the_first_failed_periodic_save(tmp_path):
    res = train(tmp_path / "run", BASE + ["training.async_save=false", "training.on_save_failure=stop"], world=1,
                extra_env={"SLURMTRON_TEST_SAVE_EIO": "1"})
    assert res.codes == [EXIT_STORAGE] and EXIT_STORAGE in REFUSAL_CODES, res.all_logs()
    (failed,) = of(res.events, "save_failed")
    assert (failed["step"], failed["cause"], failed["save"], failed["go_on"]) == (2, "storage_error", "interval", False)
    assert "EIO" in failed["detail"] and "training.on_save_failure=stop" in failed["detail"]
    assert [s["reason"] for s in of(res.events, "stop")] == ["storage_error"]
    assert not list(RunPaths.of(res.run_dir).checkpoints.glob("iter_*"))  # the torn save was removed


def test_retry_goes_on_once_and_stops_at_the_second_failure_async(tmp_path):
    res = train(tmp_path / "run", BASE + ["training.async_save=true", "training.on_save_failure=retry"], world=1,
                extra_env={"SLURMTRON_TEST_SAVE_EIO": "2"})
    assert res.codes == [EXIT_STORAGE], res.all_logs()
    failed = of(res.events, "save_failed")
    assert [(f["policy"], f["go_on"], f["in_a_row"]) for f in failed] == [("retry", True, 1), ("retry", False, 2)]
    assert "the retry at the next interval failed too" in failed[1]["detail"]
    assert "WARNING: the checkpoint of iteration 2 failed (storage_error" in res.log()


def test_skip_goes_on_and_the_run_completes(tmp_path):
    from analysis.figures import save_figures

    res = train(tmp_path / "run", BASE + ["training.async_save=false", "training.on_save_failure=skip",
                                          "training.max_skipped_saves=2"], world=1,
                extra_env={"SLURMTRON_TEST_SAVE_EIO": "2"})
    assert res.codes == [0], res.all_logs()
    failed = of(res.events, "save_failed")
    assert [(f["step"], f["go_on"]) for f in failed] == [(2, True), (4, True)]
    assert [e["step"] for e in of(res.events, "checkpoint_saved")] == [6, 8]
    f = save_figures(res.events)  # what the report counts
    assert f["failed"] == 2 and f["failed_by_cause"] == {"storage_error": 2} and f["saves"] == 2
    cost = of(res.events, "checkpoint_cost")
    assert all(c["mode"] == "sync" and c["blocked_s"] == c["durable_s"] > 0 and c["dip"] is None for c in cost)


def test_a_stuck_writer_is_abandoned_at_its_deadline_and_training_goes_on(tmp_path):
    # the writer of step 2 sleeps 600 s; the deadline is max(3 x slowest save (none yet), 3 s) = 3 s; every step
    # sleeps 0.5 s, so the 10 steps after the save outlast the deadline and the abandon happens while training
    res = train(tmp_path / "run", BASE + [
        f"training.train_iters={ITERS + 4}", "training.async_save=true", "training.on_save_failure=skip",
        "training.watchdog.save_floor_s=3", "training.watchdog.enabled=false"], world=1, timeout=300,
        extra_env={"SLURMTRON_TEST_ASYNC_HANG_AT": "2", "SLURMTRON_TEST_HANG_S": "600",
                   "SLURMTRON_TEST_STEP_SLEEP_S": "0.5"})
    assert res.codes == [0], res.all_logs()
    (ab,) = of(res.events, "checkpoint_abandoned")
    assert (ab["step"], ab["cause"], ab["limit_s"]) == (2, "writer_stuck", 3.0) and ab["seconds"] > 3.0
    (failed,) = of(res.events, "save_failed")
    assert (failed["cause"], failed["go_on"]) == ("writer_stuck", True)
    later = [e["step"] for e in of(res.events, "iteration") if e["time"] > ab["time"]]
    assert later and max(later) == ITERS + 4  # training went on after the abandon
    root = RunPaths.of(res.run_dir).checkpoints
    # never committed, never loaded (its iter_0000002.tmp is left to the next commit's prune of leftovers)
    assert not (root / "iter_0000002").exists() and 2 not in [e["step"] for e in of(res.events, "checkpoint_saved")]
    assert find_latest_verified(root).step == ITERS + 4
    costs = of(res.events, "checkpoint_cost")
    asyncs = [c for c in costs if c["mode"] == "async"]
    assert asyncs and all(0 < c["blocked_s"] <= c["durable_s"] for c in asyncs)
    assert "training blocked" in res.log() and "step time during the write" in res.log()
