"""TensorBoard and W&B writers of ``train/tracking.py``, read back with the packages' own readers."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from launch.compose import compose_job
from train.tracking import NAMES, Tracker, open_tracker, wandb_resume, wandb_run_id

pytest.importorskip("tensorboard")  # the optional extra [tracking]; the test extra installs it


def _job(tmp_path, *extra):
    return compose_job([f"run.dir={tmp_path / 'run'}", "run.name=run", *extra])


def _attempt(job, paths, resumed_step, steps, events=()):
    tr = open_tracker(job, paths, resumed_step=resumed_step, warn=lambda s: None)
    for step in steps:
        tr.scalars(step, {"loss": 10.0 - step / 10, "lr": 1e-4, "grad_norm": 1.0, "iteration_time": 0.5,
                          "mfu": None})
    for step, text in events:
        tr.text(step, text)
    tr.close()


def _scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_a_requeue_leaves_one_point_per_step_in_order(tmp_path):
    job = _job(tmp_path)
    paths = job.paths_at(tmp_path / "run")
    _attempt(job, paths, 0, range(1, 9), events=[(8, "preempted at step 8; last checkpoint at step 5")])
    _attempt(job, paths, 5, range(6, 13))  # the requeued attempt redoes steps 6..8 from the step-5 checkpoint
    assert len(list(paths.tensorboard.glob("events.out.tfevents.*"))) == 2
    points = _scalars(paths.tensorboard, NAMES["loss"])
    assert [s for s, _ in points] == list(range(1, 13))  # no duplicate, none out of order
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = EventAccumulator(str(paths.tensorboard)).Reload().Tags()
    assert {NAMES[k] for k in ("loss", "lr", "grad_norm", "iteration_time")} <= set(tags["scalars"])
    assert "mfu" not in tags["scalars"]  # None (a CPU run) is not written as a number
    assert "events/text_summary" in tags["tensors"]  # the preemption note, as text


def test_megatron_names():
    assert NAMES["loss"] == "lm loss" and NAMES["lr"] == "learning-rate" and NAMES["grad_norm"] == "grad-norm"
    assert NAMES["val_loss"] == "lm loss validation" and NAMES["val_ppl"] == "lm loss validation ppl"


def test_a_missing_package_is_a_warning_and_an_event(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_wandb(name, *a, **k):
        if name == "wandb":
            raise ImportError("No module named 'wandb'", name="wandb")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    job = _job(tmp_path, "tracking.wandb=true", "tracking.tensorboard=false")
    warned, events = [], []
    tr = open_tracker(job, job.paths_at(tmp_path / "run"), resumed_step=0, warn=warned.append,
                      emit=lambda kind, **f: events.append((kind, f)))
    assert tr.writers == [] and "WARNING: tracking.wandb" in warned[0] and events[0][0] == "tracking_unavailable"


def test_a_failing_writer_is_dropped_with_a_warning():
    class Broken:
        def scalars(self, step, values):
            raise OSError("disk full")

    warned = []
    tr = Tracker([Broken()], warn=warned.append)
    tr.scalars(1, {"loss": 1.0})
    tr.scalars(2, {"loss": 1.0})
    assert tr.writers == [] and len(warned) == 1 and "disk full" in warned[0]


def test_the_wandb_id_is_made_once(tmp_path):
    ids = iter(["first", "second"])
    path = tmp_path / "wandb_id"
    assert wandb_run_id(path, lambda: next(ids)) == "first"
    assert wandb_run_id(path, lambda: next(ids)) == "first"


def wandb_history(offline_run: Path) -> list[dict]:
    """The history rows of an offline W&B run, read from its transaction log (``run-<id>.wandb``: a LevelDB-style
    log of W&B's own protobuf records: 7-byte file header, 32 KiB blocks, 7-byte chunk headers)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = offline_run.glob("*.wandb")
    data, pos, buf, rows = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # block trailer / padding
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk  # FULL/FIRST start a record, MIDDLE/LAST continue it
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            if rec.WhichOneof("record_type") == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
            buf = b""
    return rows


def test_wandb_offline_two_attempts_share_one_run_id_and_say_once_that_steps_may_repeat(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    for key in [k for k in os.environ if k.startswith("WANDB_")]:  # W&B reads its settings from these too
        monkeypatch.delenv(key)
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb.teardown()  # no W&B state left in this process by anything before
    job = _job(tmp_path, "tracking.wandb=true", "tracking.tensorboard=false")
    paths = job.paths_at(tmp_path / "run")
    paths.run_dir.mkdir(parents=True)
    warned: list = []
    events: list = []
    runs: list = []
    for resumed, steps in ((0, range(1, 6)), (3, range(4, 9))):  # the second attempt redoes 4, 5 from step 3
        before = set((paths.run_dir / "wandb").glob("offline-run-*"))
        tr = open_tracker(job, paths, resumed_step=resumed, warn=warned.append,
                          emit=lambda kind, **f: events.append((kind, f)))
        assert len(tr.writers) == 1, warned
        tr.text(resumed + 1, f"attempt starts at step {resumed + 1}")
        for step in steps:
            tr.scalars(step, {"loss": 5.0 - step / 10})
        tr.close()
        # closed: W&B's service is shut down and this attempt's transaction log is complete, read at once
        (run,) = set((paths.run_dir / "wandb").glob("offline-run-*")) - before  # offline-run-<time>-<id>[-<n>]
        rows = [r for r in wandb_history(run) if NAMES["loss"] in r]
        # W&B's step is the iteration
        assert [r["_step"] for r in rows] == list(steps), (run, warned)
        assert [r[NAMES["loss"]] for r in rows] == pytest.approx([5.0 - s / 10 for s in steps])
        runs.append(run)
    run_id = paths.wandb_id.read_text().strip()
    assert all((r / f"run-{run_id}.wandb").is_file() for r in runs)
    assert any("wandb sync" in w for w in warned)
    assert not [w for w in warned if "failed" in w]  # every attempt logged and finished its W&B run
    # offline cannot rewind: the resumed attempt (only) says so once, as a WARNING line and an event
    repeats = [w for w in warned if "may appear twice" in w]
    assert len(repeats) == 1 and repeats[0].startswith("WARNING: tracking.wandb") and "TensorBoard" in repeats[0]
    assert [(k, f["step"], f["mode"]) for k, f in events if k == "tracking_fallback"] == [("tracking_fallback", 3,
                                                                                           "offline")]


def test_an_online_resume_rewinds_the_w_and_b_run_to_the_checkpoint_step():
    wandb = pytest.importorskip("wandb")
    assert wandb_resume("abc", "online", 0) == ({"id": "abc", "resume": "allow"}, "")
    how, repeats = wandb_resume("abc", "online", 40)
    assert how == {"id": "abc", "resume_from": "abc?_step=40"} and repeats == ""
    # W&B's own settings accept exactly this (resume_from and resume are exclusive; the ids must agree)
    settings = wandb.Settings(run_id=how["id"], resume_from=how["resume_from"])
    assert (settings.resume_from.run, settings.resume_from.value, settings.resume_from.metric) == ("abc", 40, "_step")
    how, repeats = wandb_resume("abc", "offline", 40)
    assert how == {"id": "abc", "resume": "allow"} and "may appear twice" in repeats


def test_the_validation_block_is_megatrons_and_the_analysis_reads_it():
    import math

    from analysis.parse_validation import parse_validation_text
    from train.train_loop import format_validation

    block = format_validation(12, 4.5)
    dashes, line, dashes2 = block.splitlines()
    assert line == " validation loss at iteration 12 | lm loss value: 4.500000E+00 | lm loss PPL: 9.001713E+01 | "
    assert set(dashes) == {"-"} and len(dashes) == len(line) + 1 and dashes == dashes2
    df = parse_validation_text("noise\n" + block + "\n[2026] iteration 13/ 20 | lm loss: 4.4 |\n")
    assert df[["iteration", "val_loss"]].values.tolist() == [[12, 4.5]]
    assert df["val_ppl"].iloc[0] == float(f"{math.exp(4.5):.6E}")
