"""Replay parity on real Megatron-Core training (CPU, gloo): a resumed run proves its checkpoint.

One lost attempt (crash at iteration 6; checkpoints 2 and 4; steps 1-5 logged) is run once; each test resumes a
copy of it. Untouched, the replayed step matches the log bitwise. With the checkpoint's data position moved by one
global batch *and the manifest re-sealed* (every SHA-256 valid: the verified resume loads it), replay parity catches
it under each policy: ``warn`` trains on, ``stop`` ends final (exit 16) with nothing deleted or saved, ``rollback``
quarantines it, replays from the checkpoint before and ends with the untouched resume's losses. A resume in
another layout (TP2 on two ranks) matches within the tolerance.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from trainutil import RunResult, train, write_job
from launch.paths import RunPaths
from recovery.commit import HASH_NAME, MANIFEST, digest_key, final_path, seal_files
from recovery.policy import EXIT_REPLAY_MISMATCH, REFUSAL_CODES
from recovery.quarantine import list_quarantine

pytestmark = pytest.mark.training

ITERS = 8
BASE = ["parallelism=tp1", f"training.train_iters={ITERS}", "training.checkpoint_interval=2",
        "training.async_save=false", "training.global_batch_size=8"]
CRASH = {"SLURMTRON_TEST_FAIL_AT_ITER": "6"}


def of(events: list, kind: str) -> list:
    return [e for e in events if e["event"] == kind]


@pytest.fixture(scope="module")
def lost(tmp_path_factory) -> RunResult:
    run = tmp_path_factory.mktemp("lost") / "run"
    res = train(run, BASE + [f"run.dir={run}"], world=1, extra_env=CRASH)
    assert res.codes == [1], res.all_logs()
    assert sorted(res.losses) == [1, 2, 3, 4, 5]
    assert [e["step"] for e in of(res.events, "checkpoint_saved")] == [2, 4]
    return res


def resume(lost: RunResult, where: Path, *extra: str, world: int = 1, shift: int = 0) -> RunResult:
    """A copy of the lost run, resumed once (attempt 1) with ``extra``; ``shift``: move iter_4's data position."""
    run = where / "run"
    shutil.copytree(lost.run_dir, run)
    write_job(run, BASE + [f"cluster.gpus_per_node={world}", f"run.dir={run}", *extra])
    if shift:
        reseal_shifted(final_path(RunPaths.of(run).checkpoints, 4), shift)
    return train(run, [], world=world, attempt=1)


def reseal_shifted(ckpt: Path, shift: int) -> None:
    """The right bytes of the wrong state: consumed_samples moved by ``shift``, then every digest made valid again."""
    import torch

    common = torch.load(ckpt / "common.pt", weights_only=False)  # this test's own file
    common["training_state"]["consumed_samples"] += shift
    torch.save(common, ckpt / "common.pt")
    doc = json.loads((ckpt / MANIFEST).read_text())
    doc["meta"]["consumed_samples"] += shift
    sealed = seal_files(ckpt, list(doc["files"]))
    doc["files"] = {rel: {"size": n, digest_key(HASH_NAME): d} for rel, (n, d) in sealed.items()}
    (ckpt / MANIFEST).write_text(json.dumps(doc, indent=1, sort_keys=True))


@pytest.fixture(scope="module")
def clean(lost, tmp_path_factory) -> RunResult:
    res = resume(lost, tmp_path_factory.mktemp("clean"))
    assert res.codes == [0], res.all_logs()
    return res


def mine(res: RunResult) -> list:
    return [e for e in res.events if e.get("restart_count") == 1]


def test_a_resume_after_a_crash_replays_the_lost_steps_bitwise(lost, clean):
    ev = mine(clean)
    (match,) = of(ev, "replay_match")
    assert (match["mode"], match["steps"], match["max_rel"]) == ("bitwise", [5], 0.0)
    assert match["detail"] == "replayed step 5 matches the lost attempt bitwise"
    assert "replayed step 5 matches the lost attempt bitwise" in clean.log(1)
    assert not of(ev, "replay_mismatch")
    assert clean.losses[5] == lost.losses[5]


def test_warn_trains_on_after_a_mismatch_it_reports_with_the_numbers(lost, clean, tmp_path):
    res = resume(lost, tmp_path, "training.replay.on_mismatch=warn", shift=8)
    assert res.codes == [0], res.all_logs()
    (bad,) = of(mine(res), "replay_mismatch")
    assert bad["step"] == 5 and bad["policy"] == "warn" and bad["mode"] == "bitwise"
    fields = {d["field"]: d for d in bad["diffs"]}
    assert fields["consumed_samples"]["logged"] == 40 and fields["consumed_samples"]["replayed"] == 48
    assert "loss" in fields and fields["loss"]["rel"] > 0
    assert "WARNING: replayed step 5 does not match the lost attempt" in res.log(1)
    assert [res.losses[s] != clean.losses[s] for s in (6, 7, 8)] == [True] * 3  # the wrong state trained on


def test_stop_is_final_and_deletes_nothing(lost, tmp_path):
    res = resume(lost, tmp_path, shift=8)  # auto: stop, since bitwise was expected
    assert res.codes == [EXIT_REPLAY_MISMATCH] and EXIT_REPLAY_MISMATCH in REFUSAL_CODES, res.all_logs()
    ev = mine(res)
    (bad,) = of(ev, "replay_mismatch")
    assert bad["policy"] == "stop"
    (stop,) = of(ev, "stop")
    assert (stop["reason"], stop["code"]) == ("replay_mismatch", EXIT_REPLAY_MISMATCH)
    root = RunPaths.of(res.run_dir).checkpoints
    assert sorted(p.name for p in root.glob("iter_*")) == ["iter_0000002", "iter_0000004"]  # nothing saved/deleted
    assert not of(ev, "checkpoint_saved") and not list_quarantine(root)


def test_rollback_quarantines_the_checkpoint_and_ends_like_the_clean_resume(lost, clean, tmp_path):
    res = resume(lost, tmp_path, "training.replay.on_mismatch=rollback", shift=8)
    assert res.codes == [0], res.all_logs()
    ev = mine(res)
    assert [e["policy"] for e in of(ev, "replay_mismatch")] == ["rollback"]
    (back,) = of(ev, "replay_rollback")
    assert (back["from_step"], back["to_step"]) == (4, 2)
    (match,) = of(ev, "replay_match")
    assert match["steps"] == [3, 4, 5] and match["mode"] == "bitwise"
    root = RunPaths.of(res.run_dir).checkpoints
    assert [name.split(".")[0] for name, _ in list_quarantine(root)] == ["iter_0000004"]
    last = {s: res.losses[s] for s in (6, 7, 8)}
    assert last == {s: clean.losses[s] for s in (6, 7, 8)}


def test_another_layout_matches_within_the_tolerance(lost, tmp_path):
    res = resume(lost, tmp_path, "parallelism=tp2", world=2)
    assert res.codes == [0, 0], res.all_logs()
    (match,) = of(mine(res), "replay_match")
    assert match["mode"] == "tolerance" and match["policy"] == "warn" and match["max_rel"] < 1e-3
    assert "within the relative tolerance" in match["detail"]


def test_one_edited_logged_loss_costs_at_most_one_checkpoint_over_every_launch(lost, tmp_path):
    """A digit of the logged loss of step 5 changed in events.jsonl, then two attempts under rollback: the first
    quarantines iter_4 and, the mismatch repeating from iter_2, stops (exit 16); the second stops at the same
    evidence without quarantining iter_2, so the run keeps a verified checkpoint to resume from."""
    run = tmp_path / "run"
    shutil.copytree(lost.run_dir, run)
    write_job(run, BASE + ["cluster.gpus_per_node=1", f"run.dir={run}", "training.replay.on_mismatch=rollback"])
    events = RunPaths.of(run).events
    lines = events.read_text().splitlines()
    for i, line in enumerate(lines):
        e = json.loads(line)
        if e.get("event") == "iteration" and e.get("step") == 5:
            loss = str(e["loss"])
            e["loss"] = type(e["loss"])(loss[:-1] + ("1" if loss[-1] != "1" else "2"))
            lines[i] = json.dumps(e)
    events.write_text("\n".join(lines) + "\n")
    root = RunPaths.of(run).checkpoints
    first = train(run, [], world=1, attempt=1)
    assert first.codes == [EXIT_REPLAY_MISMATCH], first.all_logs()
    assert [name.split(".")[0] for name, _ in list_quarantine(root)] == ["iter_0000004"]
    second = train(run, [], world=1, attempt=2)
    assert second.codes == [EXIT_REPLAY_MISMATCH], second.all_logs()
    assert [name.split(".")[0] for name, _ in list_quarantine(root)] == ["iter_0000004"]  # nothing more moved
    assert (root / "iter_0000002").is_dir()
    (stop,) = [e for e in of(second.events, "stop") if e.get("restart_count") == 2]
    assert "already had a checkpoint quarantined in an earlier attempt" in stop["detail"]
    assert "quarantine" in stop["detail"] and not of([e for e in second.events if e.get("restart_count") == 2],
                                                     "replay_rollback")
