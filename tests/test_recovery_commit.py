"""The commit protocol and the verified-resume search, on a real temporary filesystem.

The crash tests stop :func:`recovery.commit.commit` after every single storage operation
(a subclass of the real storage that raises once its budget of operations is used up) and
check the invariant: the resume search returns either the previous checkpoint or the new
one, intact, never a torn one; and a retried save of the same step then succeeds.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from recovery.commit import (
    LATEST,
    MANIFEST,
    commit,
    final_path,
    prepare_staging,
    prune,
    read_latest,
    staging_path,
)
from recovery.resume import find_latest_verified, main as resume_main, verify
from recovery.storage import LocalStorage


def write_shards(root: Path, step: int, *, payload: bytes = b"", storage=None) -> Path:
    """What the ranks do: write shard files (and a sub-directory) into the staging dir."""
    d = prepare_staging(root, step, storage=storage)
    body = payload or (f"step {step} ".encode() * 1000)
    (d / "__0_0.distcp").write_bytes(body)
    (d / "__1_0.distcp").write_bytes(body[::-1])
    (d / "common.pt").write_bytes(b"common" + str(step).encode())
    (d / "sub").mkdir()
    (d / "sub" / "rng.pt").write_bytes(os.urandom(64))
    return d


def save(root: Path, step: int, keep: int = 3, storage=None, **meta):
    write_shards(root, step, storage=storage)
    return commit(root, step, {"step": step, **meta}, keep=keep, storage=storage)


def test_paths():
    assert staging_path(Path("r"), 10) == Path("r/iter_0000010.tmp")
    assert final_path(Path("r"), 10) == Path("r/iter_0000010")


def test_commit_writes_manifest_latest_and_resume_finds_it(tmp_path):
    res = save(tmp_path, 10, optimizer="dist", layout={"tp": 2})
    assert res.path == tmp_path / "iter_0000010"
    assert res.files == 4
    assert res.bytes == sum(p.stat().st_size for p in res.path.rglob("*") if p.is_file() and p.name != MANIFEST)
    assert not staging_path(tmp_path, 10).exists()
    doc = json.loads((res.path / MANIFEST).read_text())
    assert doc["step"] == 10 and doc["hash"] == "sha256" and doc["version"] == 2
    assert all(set(f) == {"size", "sha256"} for f in doc["files"].values())
    assert set(doc["files"]) == {"__0_0.distcp", "__1_0.distcp", "common.pt", "sub/rng.pt"}
    assert (tmp_path / LATEST).read_text().strip() == "iter_0000010"
    r = find_latest_verified(tmp_path)
    assert (r.path, r.step, r.skipped) == (res.path, 10, [])
    assert r.meta == {"step": 10, "optimizer": "dist", "layout": {"tp": 2}}


def test_empty_root_has_nothing_to_resume(tmp_path):
    r = find_latest_verified(tmp_path / "missing")
    assert r.path is None and r.step is None and r.skipped == []


def test_prepare_staging_removes_a_stale_torn_save(tmp_path):
    d = staging_path(tmp_path, 20)
    d.mkdir(parents=True)
    (d / "stale_shard.distcp").write_bytes(b"from a killed save")
    prepare_staging(tmp_path, 20)
    assert d.is_dir() and list(d.iterdir()) == []


def test_commit_without_staging_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="prepare_staging"):
        commit(tmp_path, 5, {}, keep=1)
    with pytest.raises(ValueError, match="keep"):
        commit(tmp_path, 5, {}, keep=0)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "extra", "manifest", "no_manifest", "step"])
def test_damaged_checkpoint_is_skipped_with_a_reason_and_previous_used(tmp_path, damage):
    save(tmp_path, 10)
    save(tmp_path, 20)
    bad = final_path(tmp_path, 20)
    shard = bad / "__0_0.distcp"
    if damage == "flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
        expect = "checksum mismatch __0_0.distcp"
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-1])
        expect = "size mismatch __0_0.distcp"
    elif damage == "delete":
        shard.unlink()
        expect = "missing file __0_0.distcp"
    elif damage == "extra":
        (bad / "__9_0.distcp").write_bytes(b"x")
        expect = "unlisted file __9_0.distcp"
    elif damage == "manifest":
        (bad / MANIFEST).write_text('{"format": "slurmtron-checkpoint", "ver')
        expect = "manifest.json unreadable"
    elif damage == "no_manifest":
        (bad / MANIFEST).unlink()
        expect = "no manifest.json"
    else:
        doc = json.loads((bad / MANIFEST).read_text())
        doc["step"] = 30
        (bad / MANIFEST).write_text(json.dumps(doc))
        expect = "manifest step 30 != directory step 20"
    assert expect in verify(bad)
    r = find_latest_verified(tmp_path)
    assert r.step == 10 and r.path == final_path(tmp_path, 10)
    assert [p for p, _ in r.skipped] == [bad]
    assert expect in r.skipped[0][1]
    assert r.latest_hint == "iter_0000020"  # the hint named the bad one; the search did not trust it


def test_flip_in_a_shard_passes_the_cheap_check_but_not_the_deep_one(tmp_path):
    res = save(tmp_path, 10)
    shard = res.path / "sub" / "rng.pt"
    data = bytearray(shard.read_bytes())
    data[0] ^= 0x80
    shard.write_bytes(bytes(data))
    assert verify(res.path, deep=False) is None
    assert "checksum mismatch sub/rng.pt" in verify(res.path)


def test_staging_dir_of_a_newer_step_is_skipped(tmp_path):
    save(tmp_path, 10)
    write_shards(tmp_path, 20)  # killed before commit
    r = find_latest_verified(tmp_path)
    assert r.step == 10
    assert r.skipped[0][0] == staging_path(tmp_path, 20)
    assert "staging" in r.skipped[0][1]


def test_keep_prunes_oldest_and_never_the_latest_target(tmp_path):
    for s in (10, 20, 30):
        save(tmp_path, s, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["iter_0000020", "iter_0000030"]
    # latest pointing at an older checkpoint (set by hand to roll back) protects it from the prune
    (tmp_path / LATEST).write_text("iter_0000020\n")
    removed = prune(tmp_path, keep=1).removed
    assert removed == []
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["iter_0000020", "iter_0000030"]
    (tmp_path / LATEST).write_text("iter_0000030\n")
    assert prune(tmp_path, keep=1).removed == [final_path(tmp_path, 20)]


def test_prune_keeps_k_verified_not_k_directories(tmp_path):
    for s in (10, 20, 30):
        save(tmp_path, s, keep=5)
    (final_path(tmp_path, 30) / "common.pt").write_bytes(b"")  # damaged (size) newest
    prune(tmp_path, keep=2)
    names = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    # two good ones (20, 10) are kept; the damaged 30 stays for inspection, resume skips it
    assert names == ["iter_0000010", "iter_0000020", "iter_0000030"]
    assert find_latest_verified(tmp_path).step == 20


def test_resaving_an_existing_step_replaces_it(tmp_path):
    save(tmp_path, 10)
    save(tmp_path, 20)
    # the run was rewound to 10 (e.g. 20 found corrupt) and reaches step 20 again
    write_shards(tmp_path, 20, payload=b"new bytes" * 100)
    res = commit(tmp_path, 20, {"attempt": 2}, keep=3)
    assert (res.path / "__0_0.distcp").read_bytes() == b"new bytes" * 100
    assert not Path(str(res.path) + ".old").exists()
    r = find_latest_verified(tmp_path)
    assert r.step == 20 and r.meta == {"attempt": 2}


def test_cli_prints_choice_and_skips(tmp_path, capsys):
    save(tmp_path, 10)
    write_shards(tmp_path, 20)
    assert resume_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "iter_0000020.tmp: staging directory" in out and '"step": 10' in out
    assert "a restart would load" in out and "iter_0000010" in out
    # a missing or non-directory path: one line on stderr, exit 2, no traceback, no JSON null
    assert resume_main([str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "does not exist" in err
    assert resume_main([str(tmp_path / LATEST)]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "not a directory" in err


# ---- crash between any two storage operations ---------------------------------------------

class SimulatedCrash(Exception):
    pass


class CrashingStorage(LocalStorage):
    """The real storage, except that the (budget+1)-th mutating operation raises instead of running."""

    MUTATING = ("makedirs", "remove_tree", "write_text", "fsync_file", "fsync_dir", "rename", "replace")

    def __init__(self, budget: int):
        self.budget = budget
        self.ops: list[str] = []

    def __getattribute__(self, name):
        attr = object.__getattribute__(self, name)
        if name in CrashingStorage.MUTATING:
            def wrapped(*args, **kwargs):
                if len(self.ops) >= self.budget:
                    raise SimulatedCrash(f"crash before {name}{args}")
                self.ops.append(name)
                return attr(*args, **kwargs)
            return wrapped
        return attr


def count_commit_ops(tmp_path: Path, replace_existing: bool) -> int:
    root = tmp_path / "probe"
    save(root, 10, keep=1)
    if replace_existing:
        save(root, 20, keep=1)
    write_shards(root, 20)
    st = CrashingStorage(budget=10**9)
    commit(root, 20, {"n": 2}, keep=1, storage=st)
    return len(st.ops)


@pytest.mark.parametrize("replace_existing", [False, True])
def test_crash_after_every_operation_never_yields_a_torn_checkpoint(tmp_path, replace_existing):
    total = count_commit_ops(tmp_path, replace_existing)
    assert total >= 10  # fsyncs, manifest, renames, latest, prune
    for budget in range(total + 1):
        root = tmp_path / f"b{budget}"
        save(root, 10, keep=1)
        if replace_existing:
            save(root, 20, keep=1)  # an earlier attempt's step 20, then rewound and re-saved
        write_shards(root, 20, payload=b"attempt 2 " * 500)
        st = CrashingStorage(budget)
        crashed = False
        try:
            commit(root, 20, {"attempt": 2}, keep=1, storage=st)
        except SimulatedCrash:
            crashed = True
        assert crashed == (budget < total), budget
        r = find_latest_verified(root)
        assert r.path is not None, (budget, r.skipped)
        assert verify(r.path) is None
        if r.step == 20:
            body = (r.path / "__0_0.distcp").read_bytes()
            assert body in (b"attempt 2 " * 500, b"step 20 " * 1000), budget
        else:
            assert r.step == 10, (budget, r)
        latest = read_latest(root)
        assert latest is None or (root / latest).is_dir() or latest == "iter_0000020", (budget, latest)
        # the next attempt saves the same step again and must succeed over whatever is left
        write_shards(root, 20, payload=b"attempt 3 " * 500)
        commit(root, 20, {"attempt": 3}, keep=1)
        r = find_latest_verified(root)
        assert r.step == 20 and r.meta == {"attempt": 3}
        assert (r.path / "__0_0.distcp").read_bytes() == b"attempt 3 " * 500
        assert read_latest(root) == "iter_0000020"
        assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["iter_0000020"]


def test_fault_harness_byte_flip_is_caught_by_verification(tmp_path):
    """The fault tests' corruption (tests/faults.py) really damages the newest checkpoint."""
    from faults import Fault, flip_byte_in_latest

    save(tmp_path, 10)
    save(tmp_path, 20)
    target = flip_byte_in_latest(tmp_path)
    assert target is not None and target.parent == final_path(tmp_path, 20)
    assert "checksum mismatch" in verify(final_path(tmp_path, 20))
    assert find_latest_verified(tmp_path).step == 10
    assert flip_byte_in_latest(tmp_path / "none") is None
    with pytest.raises(ValueError, match="kind"):
        Fault("reboot")


class CountingStorage(LocalStorage):
    """The real storage, recording which files get read for hashing."""

    def __init__(self):
        self.hashed: list[str] = []

    def digest(self, path, **kw):
        self.hashed.append(Path(path).name)
        return super().digest(path, **kw)


def test_commit_with_digests_sealed_by_the_writing_ranks(tmp_path):
    from recovery.commit import seal_files

    a, b = tmp_path / "a", tmp_path / "b"
    for root in (a, b):
        d = write_shards(root, 10, payload=b"same bytes" * 100)
        (d / "sub" / "rng.pt").write_bytes(b"fixed rng")
    plain = commit(a, 10, {}, keep=1)
    # ranks 0 and 1 seal their own shards; rank 0 commits and only reads the rest
    staging = staging_path(b, 10)
    gathered = {**seal_files(staging, ["__0_0.distcp"]), **seal_files(staging, ["__1_0.distcp"])}
    st = CountingStorage()
    res = commit(b, 10, {}, keep=1, digests=gathered, storage=st)
    assert sorted(st.hashed) == ["common.pt", "rng.pt"]
    doc_a = json.loads((plain.path / MANIFEST).read_text())["files"]
    doc_b = json.loads((res.path / MANIFEST).read_text())["files"]
    assert doc_a == doc_b and res.bytes == plain.bytes
    assert verify(res.path) is None


def test_commit_refuses_digests_that_do_not_match_the_files(tmp_path):
    from recovery.commit import seal_files

    d = write_shards(tmp_path, 10)
    sealed = seal_files(d, ["__0_0.distcp"])
    with open(d / "__0_0.distcp", "ab") as f:
        f.write(b"written after sealing")
    with pytest.raises(ValueError, match="changed after it was sealed"):
        commit(tmp_path, 10, {}, keep=1, digests=sealed)
    with pytest.raises(ValueError, match="not in"):
        commit(tmp_path, 10, {}, keep=1, digests={"__7_0.distcp": (1, "00")})
    assert find_latest_verified(tmp_path).path is None  # nothing was committed


def as_version_1(path: Path) -> None:
    """Rewrite a committed checkpoint's manifest as the first format wrote it: BLAKE2b-256 digests."""
    import hashlib

    doc = json.loads((path / MANIFEST).read_text())
    doc["version"], doc["hash"] = 1, "blake2b-256"
    for rel, entry in doc["files"].items():
        del entry["sha256"]
        entry["blake2b"] = hashlib.blake2b((path / rel).read_bytes(), digest_size=32).hexdigest()
    (path / MANIFEST).write_text(json.dumps(doc))


def test_version_1_blake2b_manifests_still_verify_and_still_catch_a_flipped_byte(tmp_path):
    old = save(tmp_path, 10).path
    as_version_1(old)
    assert verify(old) is None
    assert find_latest_verified(tmp_path).path == old
    save(tmp_path, 20)  # a new (version 2) checkpoint next to it; the prune keeps the old one (keep=3)
    assert verify(old) is None and verify(final_path(tmp_path, 20)) is None
    shard = old / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[7] ^= 0x01
    shard.write_bytes(bytes(data))
    assert verify(old).startswith("checksum mismatch __0_0.distcp: blake2b")


@pytest.mark.parametrize("version,hash_name,why", [
    (1, "sha256", "manifest v1 hash 'sha256'"),  # version 1 only ever carried BLAKE2b
    (2, "md5", "manifest v2 hash 'md5'"),
    (3, "sha256", "manifest format 'slurmtron-checkpoint' v3"),
])
def test_unknown_manifest_version_or_hash_is_refused(tmp_path, version, hash_name, why):
    path = save(tmp_path, 10).path
    doc = json.loads((path / MANIFEST).read_text())
    doc["version"], doc["hash"] = version, hash_name
    (path / MANIFEST).write_text(json.dumps(doc))
    assert verify(path).startswith(why)
    assert find_latest_verified(tmp_path).path is None
