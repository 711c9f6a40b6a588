"""Hostile checkpoints: no code runs from a checkpoint's pickles, no checkpoint other users can write is
loaded, and the read-only inspector gives the restart's verdict without moving anything.

The checkpoints are real distributed checkpoints (torch.distributed.checkpoint, one process) committed by
recovery.commit; a forgery replaces a pickle and reseals the manifest the way anyone who can write the
directory could (recompute SHA-256 and size).
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path

import pytest

from recovery import policy
from recovery.commit import commit, prepare_staging
from recovery.events import EventLog
from recovery.pickle_guard import check_pickle, unsafe_pickles, UnsafePickle
from recovery.quarantine import list_quarantine
from recovery.resume import explain, main as resume_main, plan_resume
from recovery.trust import TRUST_ENV, trusts_shared, writable_by_others


class Payload:
    """A pickle that, when loaded by an ordinary unpickler, creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def real_checkpoint(root: Path, step: int, run: dict | None = None) -> Path:
    """A real single-process distributed checkpoint (tensors, a BYTE_IO object, common.pt), committed."""
    import torch
    import torch.distributed.checkpoint as dcp

    staging = prepare_staging(root, step)
    state = {"w": torch.arange(8, dtype=torch.float32) * step, "extra": {"step": step, "note": "bytes record"}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(staging)), no_dist=True)
    torch.save({"training_state": {"step": step, "consumed_samples": 8 * step}}, staging / "common.pt")
    commit(root, step, {"step": step}, keep=5, run=run)
    return root / ("iter_%07d" % step)


def reseal(ckpt: Path, name: str) -> None:
    """Recompute a file's SHA-256 and size in the manifest, as recovery.commit writes them."""
    man = json.loads((ckpt / "manifest.json").read_text())
    data = (ckpt / name).read_bytes()
    man["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (ckpt / "manifest.json").write_text(json.dumps(man, indent=1, sort_keys=True))


def forge(ckpt: Path, name: str, marker: Path) -> None:
    if name == "common.pt":
        import torch

        torch.save({"training_state": Payload(marker)}, ckpt / name)
    else:
        (ckpt / name).write_bytes(pickle.dumps(Payload(marker)))
    reseal(ckpt, name)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "checkpoints"
    r.mkdir(mode=0o755)
    os.chmod(r, 0o755)
    return r


def test_a_real_checkpoint_passes_the_allow_list(root: Path) -> None:
    ckpt = real_checkpoint(root, 2)
    assert unsafe_pickles(ckpt) is None
    plan = plan_resume(root)
    assert plan.action == "resume" and plan.step == 2


def test_the_allow_list_refuses_code_and_never_runs_it(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    with pytest.raises(UnsafePickle, match="builtins.exec"):
        check_pickle(pickle.dumps(Payload(marker)), ".metadata")
    with pytest.raises(UnsafePickle, match="os.system|posix.system"):
        check_pickle(pickle.dumps(os.system), ".metadata")
    assert check_pickle(b"\x00garbage", ".metadata") is None  # no code either: loading it fails as before
    # torch's legacy format is several pickles in a row: a payload in a later one is found
    legacy = pickle.dumps(0x1950A86A20F9469CFC6C) + pickle.dumps(1001) + pickle.dumps(Payload(marker))
    with pytest.raises(UnsafePickle, match="builtins.exec"):
        check_pickle(legacy, "x.pt", every=True)
    # a truncated stream: the payload before the cut is found, nothing runs
    torn = pickle.dumps([1, 2, Payload(marker)], protocol=4)[:-3]
    with pytest.raises(UnsafePickle, match="builtins.exec"):
        check_pickle(torn, ".metadata")
    assert not marker.exists()


@pytest.mark.parametrize("name", [".metadata", "common.pt"])
def test_forged_pickle_with_a_resealed_manifest_is_refused_quarantined_and_never_run(root: Path, tmp_path: Path,
                                                                                      name: str) -> None:
    real_checkpoint(root, 2)
    ckpt = real_checkpoint(root, 4)
    marker = tmp_path / "payload-ran"
    forge(ckpt, name, marker)
    assert plan_resume(root, apply=False).reason == "unsafe_checkpoint"  # the manifest verifies: not a checksum case

    code, text = explain(root)  # the inspector: says it, moves nothing
    assert code == 3 and "would quarantine" in text and "quarantined" not in text.replace("would quarantine", "")
    assert f"the worker exits {policy.EXIT_UNSAFE_CKPT}" in text and ckpt.is_dir()

    plan = plan_resume(root)  # the restart
    assert plan.action == "refuse" and plan.reason == "unsafe_checkpoint" and "builtins.exec" in plan.detail
    assert policy.FINAL_REASONS[plan.reason] == policy.EXIT_UNSAFE_CKPT == 12
    assert not ckpt.exists() and [r for _n, r in list_quarantine(root)][0].startswith("unsafe pickle")
    assert [n["event"] for n in plan.notices] == ["quarantine"] and "quarantined" in plan.notices[0]["message"]
    assert not marker.exists()
    # a resubmission goes on from the previous verified checkpoint, not the forged one
    again = plan_resume(root)
    assert again.action == "resume" and again.step == 2


def test_a_forged_bytes_record_inside_a_shard_is_refused(root: Path, tmp_path: Path) -> None:
    """torch loads BYTE_IO records with weights_only=False: the record named by .metadata is checked too."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    ckpt = real_checkpoint(root, 2)
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata()  # our own, just written: safe to read here
    byte_fqns = {k for k, v in meta.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    info = max((v for k, v in meta.storage_data.items() if k.fqn in byte_fqns), key=lambda v: v.length)
    shard = ckpt / info.relative_path
    blob = bytearray(shard.read_bytes())
    forged = pickle.dumps(Payload(tmp_path / "ran"), protocol=2)
    assert len(forged) <= info.length
    blob[info.offset:info.offset + len(forged)] = forged  # a legacy (bare pickle) record in its place
    shard.write_bytes(bytes(blob))
    reseal(ckpt, info.relative_path)
    why = unsafe_pickles(ckpt)
    assert why and "builtins.exec" in why and info.relative_path in why
    assert plan_resume(root).reason == "unsafe_checkpoint" and not (tmp_path / "ran").exists()


def test_a_record_stored_through_a_transform_is_refused_without_decoding_it(root: Path, tmp_path: Path) -> None:
    """torch's reader undoes a record's transform_descriptors (stream.zstd/1, ...) before it unpickles the record with
    weights_only=False: the guard would judge bytes the loader never unpickles. A record naming any transform is
    refused (the ranks never write one), with the checkpoint quarantined, and nothing runs."""
    import torch.distributed.checkpoint as dcp

    real_checkpoint(root, 2)
    ckpt = real_checkpoint(root, 4)
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata()  # our own, just written: safe to read here
    assert not any(getattr(v, "transform_descriptors", None) for v in meta.storage_data.values())
    for info in meta.storage_data.values():  # what a forger writes: every record 'compressed'
        info.transform_descriptors = ["stream.zstd/1"]
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
    reseal(ckpt, ".metadata")
    why = unsafe_pickles(ckpt)
    assert why and "transform" in why and "stream.zstd/1" in why
    plan = plan_resume(root)
    assert plan.action == "refuse" and plan.reason == "unsafe_checkpoint" and "transform" in plan.detail
    assert not ckpt.exists() and plan_resume(root).step == 2


def test_a_payload_compressed_with_the_real_zstd_transform_is_refused_on_resume_and_on_export(root: Path,
                                                                                            tmp_path: Path) -> None:
    """The forgery of the hostile pass: a code-running object saved through torch's own stream.zstd transform (the
    real zstandard compressor), so the stored bytes show no global at all, and the manifest sealed. The resume
    quarantines it (exit 12) and the export refuses it (exit 12); the payload never runs."""
    pytest.importorskip("zstandard")
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard

    from train import export

    real_checkpoint(root, 2)
    marker = tmp_path / "payload-ran"
    staging = prepare_staging(root, 4)
    state = {"w": torch.arange(8, dtype=torch.float32), "extra": {"obj": Payload(marker)}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(staging), _extensions=[ZStandard()]), no_dist=True)
    torch.save({"training_state": {"step": 4, "consumed_samples": 32}}, staging / "common.pt")
    commit(root, 4, {"step": 4}, keep=5)
    ckpt = root / "iter_0000004"
    stored = b"".join(p.read_bytes() for p in ckpt.glob("*.distcp"))
    assert b"exec" not in stored and b"builtins" not in stored  # compressed: nothing for a byte scan to see
    why = unsafe_pickles(ckpt)
    assert why and "stream.zstd" in why
    run = tmp_path / "run"  # the export of the same checkpoint, in a run directory of its own
    run.mkdir()
    from launch.compose import compose_job, job_to_yaml
    (run / "config.yaml").write_text(job_to_yaml(compose_job(["cluster=local", "model=tiny", f"run.dir={run}"])))
    (run / "checkpoints").mkdir(mode=0o755)
    os.chmod(run / "checkpoints", 0o755)
    import shutil
    shutil.copytree(ckpt, run / "checkpoints" / ckpt.name)
    assert export.main([str(run), "--out", str(tmp_path / "hf"), "--step", "4"]) == policy.EXIT_UNSAFE_CKPT
    plan = plan_resume(root)
    assert plan.action == "refuse" and plan.reason == "unsafe_checkpoint" and not ckpt.exists()
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_the_rank_side_check_before_the_load_refuses_with_a_final_stop(root: Path, tmp_path: Path) -> None:
    from train.megatron_ckpt import UnsafeCheckpoint, refuse_unsafe_pickles

    ckpt = real_checkpoint(root, 2)
    refuse_unsafe_pickles(ckpt)  # a real one passes
    forge(ckpt, ".metadata", tmp_path / "ran")
    with pytest.raises(UnsafeCheckpoint) as e:
        refuse_unsafe_pickles(ckpt)
    assert e.value.stop["code"] == policy.EXIT_UNSAFE_CKPT and e.value.stop["reason"] == "unsafe_checkpoint"
    assert not (tmp_path / "ran").exists()


# ---- checkpoints other users can write -------------------------------------------------------

@pytest.mark.parametrize("target,mode", [("root", 0o775), ("ckpt", 0o777), ("file", 0o664)])
def test_a_checkpoint_other_users_can_write_is_refused_unless_trusted(root: Path, target: str, mode: int) -> None:
    ckpt = real_checkpoint(root, 2)
    path = {"root": root, "ckpt": ckpt, "file": ckpt / ".metadata"}[target]
    os.chmod(path, mode)
    plan = plan_resume(root)
    assert plan.action == "refuse" and plan.reason == "shared_checkpoint"
    assert str(path) in plan.detail and TRUST_ENV in plan.detail and "chmod -R go-w" in plan.detail
    assert policy.FINAL_REASONS["shared_checkpoint"] == policy.EXIT_SHARED_CKPT == 13
    assert ckpt.is_dir() and list_quarantine(root) == []  # not the checkpoint's fault: nothing moved
    trusted = plan_resume(root, trust_shared=True)
    assert trusted.action == "resume" and [n["event"] for n in trusted.notices] == ["shared_checkpoint_trusted"]
    assert trusts_shared({TRUST_ENV: "1"}) and not trusts_shared({}) and not trusts_shared({TRUST_ENV: "0"})


@pytest.mark.parametrize("what", ["metadata", "checkpoint"])
def test_a_symlink_is_judged_by_what_it_names_and_the_way_there(root: Path, tmp_path: Path, what: str) -> None:
    """A .metadata symlinked into another user's world-writable directory, or a whole checkpoint directory symlinked
    to a 0777 directory: refused as a shared checkpoint (exit 13) under its own name, not loaded, nothing moved."""
    ckpt = real_checkpoint(root, 2)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if what == "metadata":
        os.replace(ckpt / ".metadata", elsewhere / ".metadata")
        os.chmod(elsewhere, 0o777)  # anyone can swap the file the link names
        (ckpt / ".metadata").symlink_to(elsewhere / ".metadata")
        name = ".metadata"
    else:
        moved = elsewhere / ckpt.name
        os.replace(ckpt, moved)
        os.chmod(moved, 0o777)
        ckpt.symlink_to(moved)
        name = ckpt.name
    plan = plan_resume(root)
    assert plan.action == "refuse" and plan.reason == "shared_checkpoint", plan
    assert name in plan.detail and "symlink" in plan.detail and TRUST_ENV in plan.detail
    assert list_quarantine(root) == []
    # the same link to a directory of the run's user that nobody else can write is judged like the file itself
    os.chmod(elsewhere if what == "metadata" else elsewhere / ckpt.name, 0o755)
    assert writable_by_others(root, ckpt) is None
    assert "owned by uid" in writable_by_others(root, ckpt, uid=os.getuid() + 1)


def test_a_checkpoint_owned_by_another_uid_is_refused(root: Path) -> None:
    ckpt = real_checkpoint(root, 2)
    other = os.getuid() + 1
    assert "owned by uid" in writable_by_others(root, ckpt, uid=other)
    plan = plan_resume(root, uid=other)
    assert plan.reason == "shared_checkpoint" and "owned by uid" in plan.detail


# ---- the inspector gives the restart's verdict ------------------------------------------------

def _run_dir(tmp_path: Path, name: str = "r1") -> Path:
    """A run directory as pretrain.py writes it (config.yaml, run_id), checkpoints under it."""
    from launch.compose import compose_job, job_to_yaml

    run_dir = tmp_path / name
    run_dir.mkdir()
    job = compose_job(["cluster=local", "model=tiny", f"run.name={name}"])
    (run_dir / "config.yaml").write_text(job_to_yaml(job))
    (run_dir / "run_id").write_text("id-now\n")
    return run_dir


def test_inspector_missing_checkpoint_directory_with_committed_events_refuses_like_the_restart(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path)
    EventLog(run_dir / "events.jsonl").emit("checkpoint_saved", step=4, path="x")
    code, text = explain(run_dir)
    assert code == 3 and "storage_error" in text and f"the worker exits {policy.EXIT_STORAGE}" in text
    assert not (run_dir / "checkpoints").exists()  # read-only
    code, _ = explain(run_dir / "checkpoints")  # the checkpoint directory path names the same run
    assert code == 3


def test_inspector_foreign_run_id_refuses_like_the_restart(tmp_path: Path) -> None:
    from types import SimpleNamespace

    import yaml

    from recovery.identity import model_shape

    run_dir = _run_dir(tmp_path)
    model = model_shape(SimpleNamespace(**yaml.safe_load((run_dir / "config.yaml").read_text())["model"]))
    real_checkpoint(run_dir / "checkpoints", 2, run={"name": "r1", "id": "id-before", "model": model})
    code, text = explain(run_dir)
    assert code == 3 and "foreign_checkpoint" in text and f"exits {policy.EXIT_FOREIGN}" in text
    (run_dir / "run_id").write_text("id-before\n")
    assert explain(run_dir)[0] == 0


def test_latest_outside_the_run_and_a_checkpoint_replaced_by_a_file_are_warned(root: Path, capsys) -> None:
    real_checkpoint(root, 2)
    (root / "latest").write_text("../../other/run/checkpoints/iter_0000009\n")
    (root / "iter_0000006").write_text("not a directory\n")
    assert resume_main([str(root)]) == 0  # the inspector says it and moves nothing
    out = capsys.readouterr().out
    assert "not a checkpoint of this directory" in out and "it is not a directory" in out
    assert "latest -> (none)" not in out and "would move it to quarantine/" in out
    assert (root / "iter_0000006").is_file()
    plan = plan_resume(root)
    reasons = {n["reason"] for n in plan.notices}
    assert {"latest_invalid", "not_a_directory"} <= reasons and plan.step == 2
    # moved aside with its content, never destroyed: a save of step 6 can no longer replace it
    assert not (root / "iter_0000006").exists()
    ((name, why),) = list_quarantine(root)
    assert name.startswith("iter_0000006.") and "not a directory" in why
    assert (root / "quarantine" / name).read_text() == "not a directory\n"


@pytest.mark.training
def test_a_real_run_refuses_a_forged_checkpoint_and_the_payload_never_runs(tmp_path: Path) -> None:
    """A real Megatron-Core checkpoint, its .metadata replaced by a code-running pickle and the manifest resealed:
    the next attempt exits 12 without loading it, the checkpoint is in quarantine/, the payload never ran."""
    from trainutil import train

    from launch.paths import RunPaths

    run_dir = tmp_path / "run"
    base = ["training.train_iters=2", "training.checkpoint_interval=100", "parallelism=tp1"]
    first = train(run_dir, base, world=1, timeout=600)
    assert first.codes == [0], first.all_logs()
    root = RunPaths.of(run_dir).checkpoints
    ckpt = root / "iter_0000002"
    assert unsafe_pickles(ckpt) is None  # what Megatron-Core writes passes the allow-list
    marker = tmp_path / "payload-ran"
    forge(ckpt, ".metadata", marker)
    second = train(run_dir, base, world=1, attempt=1, timeout=600)
    assert second.codes == [policy.EXIT_UNSAFE_CKPT], second.all_logs()
    assert not marker.exists() and not ckpt.exists()
    assert [r for _n, r in list_quarantine(root)][0].startswith("unsafe pickle")
    mine = [e for e in second.events if e.get("event") in ("quarantine", "stop")]
    assert [e["event"] for e in mine][-2:] == ["quarantine", "stop"] and mine[-1]["reason"] == "unsafe_checkpoint"
    assert not any(e.get("event") == "resume" for e in second.events)
    assert "WARNING: quarantined" in second.all_logs()


def test_a_file_where_the_checkpoint_directory_belongs_is_refused_by_name_before_any_rank(tmp_path: Path) -> None:
    from launch.check import check
    from launch.compose import compose_job

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("not a directory\n")
    plan = plan_resume(run_dir / "checkpoints", committed=[2])
    assert plan.action == "refuse" and plan.reason == "storage_error"
    assert "is a file, not a directory" in plan.detail and "mounted" not in plan.detail
    job = compose_job(["cluster=local", "model=tiny", f"run.dir={run_dir}"])
    (p,) = [p for p in check(job) if "not a directory" in p.message]
    assert p.field == "run.dir" and p.arithmetic == f"{run_dir / 'checkpoints'} is a file"
    assert (run_dir / "checkpoints").read_text() == "not a directory\n"


def test_the_refusal_after_every_checkpoint_was_quarantined_says_where_and_how_to_restore(root: Path) -> None:
    from recovery.quarantine import quarantine

    ckpt = real_checkpoint(root, 2)
    moved = quarantine(root, ckpt, "replay mismatch: test")
    plan = plan_resume(root, committed=[2])
    assert plan.action == "refuse" and plan.reason == "storage_error"
    assert f"every one was moved to {root / 'quarantine'} ({moved.name}" in plan.detail
    assert f"mv {moved} {root / 'iter_0000002'}" in plan.detail and "were they moved" not in plan.detail
    os.rename(moved, root / "iter_0000002")  # doing what it says resumes
    assert plan_resume(root, committed=[2]).step == 2
