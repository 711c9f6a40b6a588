"""Storage fault sweep: every storage operation of a save and of a prune, each of {crash, ENOSPC, EACCES, EIO}, for the
global checkpoints and for a node's local set (its own shards and a peer's replica, the commit and the prune).

For each scenario the fault-free run is first counted (every call to the storage seam, reads
included, plus the ranks' shard writes); then, for every operation index i and every fault
kind, the scenario is replayed on a fresh directory with the fault injected at operation i.
An OSError fault is *sticky* (every later operation of that attempt fails the same way: a
full disk or a lost mount does not heal mid-save); a crash stops the attempt dead. After an
OSError the attempt does what the worker does: classify it and remove its staging directory
(which may itself fail). Then the invariant is checked with a healthy filesystem:

* every checkpoint that verified before the attempt is still there and verifies (same
  bytes), or was explicitly quarantined with a reason, or was deleted by the prune the
  fault-free run also does, and only with a newer verified checkpoint present;
* a resume (:func:`recovery.resume.plan_resume`) loads the newest verified checkpoint, or
  refuses with a reason; it never starts from scratch;
* the next attempt's save succeeds.

The number of injected cases is printed (``pytest -s``) and asserted to be large.
"""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from launch.paths import DELETE_SUFFIX, LocalPaths, local_set_name
from recovery import local_sets
from recovery.commit import abort_save, commit, parse_dir_name, prepare_staging, prune
from recovery.quarantine import list_quarantine
from recovery.resume import plan_resume, verify
from recovery.storage import LocalStorage, classify  # noqa: F401

FAULTS = ("crash", "ENOSPC", "EACCES", "EIO")
OPS = ("list_dir", "list_files", "list_subdirs", "size", "read_text", "digest", "makedirs", "remove_tree",
       "write_text", "write_bytes", "fsync_file", "fsync_dir", "rename", "replace", "write_shard")
ME = {"name": "sweep", "id": "id-1", "model": {"num_layers": 2}}


class SimulatedCrash(BaseException):
    """The process dies here (kill -9): nothing after it runs, no handler sees it."""


class FaultyStorage(LocalStorage):
    """The real storage; operation number ``at`` (0-based) and, for OSErrors, every later one fails."""

    def __init__(self, at: int = -1, kind: str = "crash"):
        self.at, self.kind, self.n, self.fired, self.log = at, kind, 0, False, []

    def write_shard(self, path: Path, data: bytes) -> None:  # what a rank's writer does
        with open(path, "wb") as f:
            f.write(data)

    def __getattribute__(self, name):
        attr = object.__getattribute__(self, name)
        if name not in OPS:
            return attr

        def op(*args, **kwargs):
            i = self.n
            self.n += 1
            self.log.append(name)
            if self.at >= 0 and (i == self.at or (self.fired and self.kind != "crash")):
                self.fired = True
                if self.kind == "crash":
                    raise SimulatedCrash(f"killed before {name} #{i}")
                code = getattr(errno, self.kind)
                raise OSError(code, os.strerror(code), str(args[0]) if args else "?")
            return attr(*args, **kwargs)
        return op


def _save(root: Path, step: int, st: LocalStorage, keep: int, body: bytes = b"") -> None:
    d = prepare_staging(root, step, storage=st)
    payload = body or (f"step {step} ".encode() * 300)
    st.write_shard(d / "__0_0.distcp", payload)
    st.write_shard(d / "__1_0.distcp", payload[::-1])
    st.write_shard(d / "common.pt", b"common %d" % step)
    commit(root, step, {"step": step}, keep=keep, storage=st, run=ME)


def worker_save(root: Path, step: int, st: LocalStorage, keep: int, body: bytes = b"") -> None:
    """A save as the worker does it: on a storage error, remove the staging directory, then stop."""
    try:
        _save(root, step, st, keep, body)
    except OSError as e:
        assert classify(e) is not None, e
        try:
            abort_save(root, step, storage=st)
        except OSError:
            pass  # the same fault again: the staging directory stays; a later save removes it


def fingerprint(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(path)).encode() + p.read_bytes())
    return h.hexdigest()


def verified_now(root: Path) -> dict:
    out = {}
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        parsed = parse_dir_name(p.name)
        if parsed and parsed[1] in ("", ".old") and p.is_dir() and verify(p) is None:
            out[p.name] = fingerprint(p)
    return out


@pytest.fixture
def fast_tmp(tmp_path):
    """A directory on a RAM filesystem when there is one: the sweep does thousands of fsyncs."""
    if not Path("/dev/shm").is_dir():
        yield tmp_path
        return
    d = Path(tempfile.mkdtemp(prefix="slurmtron-sweep-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---- scenarios: (setup on a healthy disk, the faulted action, keep) ----------------------------

def setup_two(root: Path) -> None:
    for s in (10, 20):
        _save(root, s, FaultyStorage(), keep=2)


DAMAGED = ("iter_0000020",)  # in setup_damaged


def setup_damaged(root: Path) -> None:
    for s in (10, 20, 30, 40):
        _save(root, s, FaultyStorage(), keep=5)
    (root / DAMAGED[0] / "common.pt").write_bytes(b"")  # damaged: must be quarantined, never deleted
    prepare_staging(root, 50)  # a torn save's leftover
    (root / "iter_0000005.del").mkdir()  # an interrupted deletion's leftover


SCENARIOS = {
    "save_new_step": (setup_two, lambda root, st: worker_save(root, 30, st, keep=2)),
    "resave_same_step": (setup_two, lambda root, st: worker_save(root, 20, st, keep=2, body=b"again " * 300)),
    "save_with_damaged_old": (setup_damaged, lambda root, st: worker_save(root, 60, st, keep=2)),
    "prune": (setup_damaged, lambda root, st: prune(root, keep=1, storage=st)),
}


def run_action(action, root: Path, st: LocalStorage) -> None:
    try:
        action(root, st)
    except SimulatedCrash:
        pass
    except OSError as e:  # a bare prune stops on the error; nothing else may escape
        assert classify(e) is not None, e


def check_invariant(root: Path, before: dict, ref_deleted: set, case: str, damaged: tuple = ()) -> None:
    """``before``/``now`` map directory names to content; a step counts as present when a verified
    ``iter_N`` or ``iter_N.old`` of that step exists (a re-save replaces a step's bytes by design)."""
    quarantined = {name.split(".")[0]: reason for name, reason in list_quarantine(root)}
    now = verified_now(root)
    steps_now = {parse_dir_name(n)[0] for n in now}
    newest_now = max(steps_now, default=-1)
    for name in before:
        step = parse_dir_name(name)[0]
        if step in steps_now:
            continue
        if name.split(".")[0] in quarantined:
            assert quarantined[name.split(".")[0]], (case, name)
            continue
        assert name in ref_deleted, (case, name, "lost", sorted(now), os.listdir(root))
        assert newest_now > step, (case, name, "deleted without a newer verified one")
    for name in damaged:  # a corrupt checkpoint is kept where it was, or quarantined: never deleted
        assert (root / name).is_dir() or name in quarantined, (case, name, "damaged checkpoint deleted")
    plan = plan_resume(root, identity=ME)
    if plan.action == "refuse":
        assert plan.reason and plan.detail, case
    else:
        assert plan.action == "resume", (case, plan)
        after = verified_now(root)
        assert plan.step == max(parse_dir_name(n)[0] for n in after), (case, plan.step, sorted(after))
        assert verify(plan.path) is None
    _save(root, 70, FaultyStorage(), keep=2)  # the next attempt saves over whatever is left
    assert plan_resume(root, identity=ME).step == 70, case


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_fault_at_every_storage_operation_keeps_the_invariant(fast_tmp, scenario, capsys):
    tmp_path = fast_tmp
    setup, action = SCENARIOS[scenario]
    ref_root = tmp_path / "reference"
    ref_root.mkdir()
    setup(ref_root)
    ref_before = verified_now(ref_root)
    counter = FaultyStorage()
    run_action(action, ref_root, counter)
    total = counter.n
    ref_deleted = set(ref_before) - set(verified_now(ref_root))
    assert total >= 15, counter.log
    cases = 0
    for at in range(total):
        for kind in FAULTS:
            root = tmp_path / f"{kind}_{at}"
            root.mkdir()
            setup(root)
            before = verified_now(root)
            st = FaultyStorage(at, kind)
            run_action(action, root, st)
            assert st.fired, (scenario, at, kind)
            damaged = DAMAGED if setup is setup_damaged else ()
            check_invariant(root, before, ref_deleted, f"{scenario} {kind} at op {at} ({counter.log[at]})", damaged)
            cases += 1
    with capsys.disabled():
        print(f"\n{scenario}: {total} storage operations x {len(FAULTS)} faults = {cases} injected cases, "
              f"invariant held in all")
    assert cases == total * len(FAULTS)


# ---- the node-local tier: one node's set (its shards and a peer's replica), commit and prune -----------------

LOCAL_ME = {"name": "sweep", "id": "id-1"}
RANK_NODES = ["node0", "node1"]


def local_save(paths: LocalPaths, step: int, st: LocalStorage, keep: int) -> None:
    """What node0's rank does for the set of ``step``: its own shard and node1's replica, then the commit."""
    staging = local_sets.begin_set(paths, "node0", step, st)
    files = {}
    for rank, node in enumerate(RANK_NODES):
        tensors, doc = LocalPaths.shard_files(node, rank)
        files.update(local_sets.write_files(staging, {tensors: f"{node} {step} ".encode() * 200,
                                                      doc: b'{"step": %d}' % step}, st))
    manifest = local_sets.build_manifest(step, "node0", run=LOCAL_ME, world=2, layout={"tp": 1}, rank_nodes=RANK_NODES,
                                         files=files, now=0.0, meta={"step": step})
    local_sets.commit_set(paths, "node0", step, staging, manifest, keep=keep, storage=st)


def worker_local_save(paths: LocalPaths, step: int, st: LocalStorage, keep: int) -> None:
    """As the rank does it: a storage error makes the save fail (a WARNING); the staging directory is removed."""
    try:
        local_save(paths, step, st, keep)
    except OSError as e:
        assert classify(e) is not None, e
        try:
            st.remove_tree(paths.staging("node0", step))
        except OSError:
            pass


def local_sets_now(paths: LocalPaths) -> tuple[dict, list]:
    """({step: fingerprint} of node0's verified sets, what the scan passed over)."""
    inv = local_sets.scan_node(paths.node_dir("node0"), "node0", identity=LOCAL_ME)
    return {h.step: fingerprint(Path(h.path)) for h in inv.sets}, inv.skipped


def local_setup_two(paths: LocalPaths) -> None:
    for step in (4, 6):
        local_save(paths, step, FaultyStorage(), keep=2)


def local_setup_leftovers(paths: LocalPaths) -> None:
    local_setup_two(paths)
    local_sets.begin_set(paths, "node0", 7, LocalStorage())  # a torn save's staging directory
    (paths.node_dir("node0") / (local_set_name(2) + DELETE_SUFFIX)).mkdir()  # an interrupted prune's leftover


LOCAL_SCENARIOS = {
    "local_save_new_step": (local_setup_two, lambda paths, st: worker_local_save(paths, 8, st, keep=2)),
    "local_save_keep_one_with_leftovers": (local_setup_leftovers,
                                           lambda paths, st: worker_local_save(paths, 8, st, keep=1)),
}


@pytest.mark.parametrize("scenario", sorted(LOCAL_SCENARIOS))
def test_every_fault_at_every_storage_operation_of_a_local_save_keeps_the_sets(fast_tmp, scenario, capsys):
    """After any fault: every set that verified before still verifies (same bytes) unless the fault-free save also
    pruned it and a newer set verifies; no committed name is left half-written or half-deleted (the scan passes
    over nothing); the start picks the newest verified set; and the next save commits."""
    setup, action = LOCAL_SCENARIOS[scenario]
    ref = LocalPaths(fast_tmp / "reference", "sweep")
    setup(ref)
    ref_before, _ = local_sets_now(ref)
    counter = FaultyStorage()
    run_action(action, ref, counter)
    total = counter.n
    ref_after, _ = local_sets_now(ref)
    ref_pruned = set(ref_before) - set(ref_after)
    assert total >= 20 and "write_bytes" in counter.log and "rename" in counter.log, counter.log
    cases = 0
    for at in range(total):
        for kind in FAULTS:
            paths = LocalPaths(fast_tmp / f"{kind}_{at}", "sweep")
            setup(paths)
            before, _ = local_sets_now(paths)
            st = FaultyStorage(at, kind)
            run_action(action, paths, st)
            assert st.fired, (scenario, at, kind)
            case = f"{scenario} {kind} at op {at} ({counter.log[at]})"
            now, skipped = local_sets_now(paths)
            assert not skipped, (case, skipped)
            for step, print_ in before.items():
                if step in now:
                    assert now[step] == print_, (case, step, "changed")
                else:
                    assert step in ref_pruned and max(now) > step, (case, step, "lost", sorted(now))
            choice = local_sets.choose(None, [local_sets.scan_node(paths.node_dir("node0"), "node0")], world=2,
                                       layout={"tp": 1}, identity=LOCAL_ME)
            assert choice.step is None or choice.step == max(now), (case, choice.step, sorted(now))
            local_save(paths, 10, FaultyStorage(), keep=2)  # the next save commits over whatever is left
            assert max(local_sets_now(paths)[0]) == 10, case
            cases += 1
    with capsys.disabled():
        print(f"\n{scenario}: {total} storage operations x {len(FAULTS)} faults = {cases} injected cases, "
              f"every verified local set kept")
    assert cases == total * len(FAULTS)
