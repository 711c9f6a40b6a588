"""The node-local checkpoint tier's pure rules (no torch, no training): the ring, the manifest and its verification,
what each node holds, the start's choice between a local set and the global checkpoint, the restore's fetch plan,
the prune, the check's refusals, and cluster=local's simulated nodes. The real training scenario is
tests/test_local_ckpt_training.py."""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from launch.check import check
from launch.check_local_ckpt import needed_bytes
from launch.compose import compose_job
from launch.dist_env import LOCAL_NODE_ENV, node_name
from launch.kinds import EventKind
from launch.local import rank_env
from launch.paths import LOCAL_MANIFEST, LocalPaths, local_set_name, parse_local_set_name
from recovery import local_sets

NODES4 = ["node0", "node0", "node1", "node1"]  # 2 nodes x 2 ranks
LAYOUT = {"tp": 1, "pp": 1, "dp": 4}
IDENTITY = {"name": "tiny", "id": "abc", "model": None}


# ---- the ring ---------------------------------------------------------------------------------------------

def test_exchange_plan_sends_each_rank_to_the_same_place_on_the_next_nodes():
    assert local_sets.exchange_plan(NODES4, 2) == [(0, 2), (1, 3), (2, 0), (3, 1)]
    three = ["a", "b", "c"]
    assert local_sets.exchange_plan(three, 2) == [(0, 1), (1, 2), (2, 0)]
    assert local_sets.exchange_plan(three, 3) == [(0, 1), (0, 2), (1, 2), (1, 0), (2, 0), (2, 1)]
    assert local_sets.exchange_plan(three, 1) == []
    assert local_sets.replica_holders("c", three, 2) == ["a"]


def test_exchange_plan_refuses_uneven_nodes():
    with pytest.raises(ValueError, match="as many ranks on every node"):
        local_sets.exchange_plan(["a", "a", "b"], 2)


# ---- sets on disk ---------------------------------------------------------------------------------------------

def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def write_set(root: Path, holder: str, step: int, owners: list[str], *, rank_nodes=NODES4, layout=LAYOUT,
              run=IDENTITY, staging: bool = False) -> Path:
    """A committed local set held by ``holder`` with the shards of ``owners``, as train/local_ckpt.py lays it out."""
    paths = LocalPaths(root, "tiny")
    d = paths.staging(holder, step) if staging else paths.set_dir(holder, step)
    files = {}
    for rank, owner in enumerate(rank_nodes):
        if owner not in owners:
            continue
        for rel in LocalPaths.shard_files(owner, rank):
            data = f"{rel} at {step}".encode() * 10
            (d / rel).parent.mkdir(parents=True, exist_ok=True)
            (d / rel).write_bytes(data)
            files[rel] = (len(data), _sha(data))
    doc = local_sets.build_manifest(step, holder, run=run, world=len(rank_nodes), layout=layout,
                                    rank_nodes=rank_nodes, files=files, now=0.0, meta={"step": step})
    (d / LOCAL_MANIFEST).write_text(json.dumps(doc))
    return d


def scan(root: Path, nodes=("node0", "node1")) -> list:
    paths = LocalPaths(root, "tiny")
    return [local_sets.scan_node(paths.node_dir(n), n) for n in nodes]


def choose(root: Path, global_step=None, **kw):
    return local_sets.choose(global_step, scan(root), world=4, layout=LAYOUT, identity=IDENTITY, **kw)


def ring_of_sets(root: Path, step: int) -> None:
    write_set(root, "node0", step, ["node0", "node1"])
    write_set(root, "node1", step, ["node1", "node0"])


def test_a_complete_set_newer_than_the_global_checkpoint_is_chosen_each_rank_from_its_own_node(tmp_path):
    ring_of_sets(tmp_path, 6)
    got = choose(tmp_path, global_step=4)
    assert got.step == 6 and got.notices == [] and got.global_step == 4
    assert {r: (h, o) for r, (h, _p, o) in got.sources.items()} == {
        0: ("node0", "node0"), 1: ("node0", "node0"), 2: ("node1", "node1"), 3: ("node1", "node1")}
    assert set(got.files[2]) == set(LocalPaths.shard_files("node1", 2))
    assert local_sets.fetch_plan(got, NODES4) == {0: None, 1: None, 2: None, 3: None}


@pytest.mark.parametrize("how", ["world_writable_file", "foreign_owner", "world_writable_node_dir", "symlink"])
def test_a_local_set_other_users_could_have_written_is_skipped_unless_trusted(tmp_path, how):
    """The global tier's trust rule on the node-local tier: a set whose manifest another user could reseal is never
    loaded silently; the resume falls back with a notice, or loads it with a trust notice under the switch."""
    ring_of_sets(tmp_path, 6)
    paths = LocalPaths(tmp_path, "tiny")
    other = tmp_path / "other"
    other.mkdir(mode=0o777)
    os.chmod(other, 0o777)

    def taint(node):
        node_dir = paths.node_dir(node)
        d = node_dir / local_set_name(6)
        if how == "world_writable_file":
            os.chmod(d / LOCAL_MANIFEST, 0o666)
        elif how == "foreign_owner":
            os.chown(d / LocalPaths.shard_files("node1", 2)[0], os.getuid() + 1, -1)
        elif how == "world_writable_node_dir":
            os.chmod(node_dir, 0o777)
        else:
            shard = d / LocalPaths.shard_files("node1", 2)[0]
            os.replace(shard, other / node)
            shard.symlink_to(other / node)
        return d

    d1 = taint("node1")  # node1's own copy: its ranks read node0's replica instead
    got = choose(tmp_path, global_step=4)
    assert got.step == 6 and {r: h for r, (h, _p, _o) in got.sources.items()} == {0: "node0", 1: "node0", 2: "node0",
                                                                                   3: "node0"}
    (n,) = [n for n in got.notices if n["path"] == str(d1)]
    assert n["event"] == EventKind.LOCAL_CHECKPOINT_SKIPPED and "other users could have written it" in n["reason"]
    assert "SLURMTRON_TRUST_SHARED_CHECKPOINTS=1" in n["reason"]
    taint("node0")  # every copy: the resume falls back to the global checkpoint of step 4
    got = choose(tmp_path, global_step=4)
    assert got.step is None and len([n for n in got.notices if "other users could" in n["reason"]]) == 2
    trusted = local_sets.choose(4, [local_sets.scan_node(paths.node_dir(x), x, trust_shared=True)
                                    for x in ("node0", "node1")], world=4, layout=LAYOUT, identity=IDENTITY)
    assert trusted.step == 6
    assert [n["event"] for n in trusted.notices] == [EventKind.SHARED_CHECKPOINT_TRUSTED] * 2  # one per node's copy


def test_the_global_checkpoint_wins_at_the_same_step_or_newer(tmp_path):
    ring_of_sets(tmp_path, 8)
    assert choose(tmp_path, global_step=8).step is None
    assert choose(tmp_path, global_step=10).step is None


def test_a_lost_node_is_restored_from_its_replica_sent_by_the_same_place_on_the_holder(tmp_path):
    write_set(tmp_path, "node0", 6, ["node0", "node1"])  # node1's directory is gone
    got = choose(tmp_path, global_step=4)
    assert got.step == 6
    assert {r: h for r, (h, _p, _o) in got.sources.items()} == {0: "node0", 1: "node0", 2: "node0", 3: "node0"}
    assert local_sets.fetch_plan(got, NODES4) == {0: None, 1: None, 2: 0, 3: 1}


def test_a_corrupt_replica_of_a_lost_node_falls_back_with_notices(tmp_path):
    d = write_set(tmp_path, "node0", 6, ["node0", "node1"])
    shard = d / LocalPaths.shard_files("node1", 2)[0]
    data = bytearray(shard.read_bytes())
    data[3] ^= 1
    shard.write_bytes(bytes(data))
    got = choose(tmp_path, global_step=4)
    assert got.step is None
    reasons = [n["reason"] for n in got.notices]
    assert any("checksum mismatch node1/rank_00002.safetensors" in r for r in reasons), reasons
    assert any("no verified copy of the shards of node(s) node1" in r for r in reasons), reasons
    assert all(n["event"] == EventKind.LOCAL_CHECKPOINT_SKIPPED and n["message"] for n in got.notices)


def test_a_corrupt_replica_costs_only_that_copy_and_an_older_complete_set_is_next(tmp_path):
    ring_of_sets(tmp_path, 5)
    d = write_set(tmp_path, "node0", 6, ["node0", "node1"])
    (d / LocalPaths.shard_files("node1", 3)[1]).unlink()  # a missing file in the replica
    got = choose(tmp_path, global_step=4)
    assert got.step == 5
    inv = local_sets.scan_node(LocalPaths(tmp_path, "tiny").node_dir("node0"), "node0")
    held6 = [s for s in inv.sets if s.step == 6][0]
    assert held6.owners == ["node0"]  # its own shards still verify


def test_the_restore_takes_a_file_unchanged_since_its_verification_and_hashes_any_other_again(tmp_path):
    d = write_set(tmp_path, "node0", 6, ["node0", "node1"])
    node_dir, st = LocalPaths(tmp_path, "tiny").node_dir("node0"), local_sets.LocalStorage()
    rel = LocalPaths.shard_files("node0", 0)[0]
    data = (d / rel).read_bytes()
    later = lambda: time.time() + 60  # noqa: E731 (verified a minute after the save)
    (held,) = local_sets.scan_node(node_dir, "node0", clock=later).sets
    entry, seen = held.files[rel], held.seen[rel]
    assert set(held.seen) == set(held.files) and seen == list(st.identity(d / rel))
    # unchanged: the start's SHA-256 stands (a manifest entry that no longer matches would fail a hash)
    assert local_sets.read_checked(d / rel, {**entry, "sha256": "0" * 64}, seen, st) == data
    # replaced since (same size, one byte flipped, renamed over it): hashed again and refused
    flipped = bytearray(data)
    flipped[5] ^= 1
    (d / "new").write_bytes(bytes(flipped))
    os.replace(d / "new", d / rel)
    with pytest.raises(ValueError, match="changed since the start verified it"):
        local_sets.read_checked(d / rel, entry, seen, st)
    (d / rel).write_bytes(data)  # the original bytes again, under a new identity: hashed, and they match
    assert local_sets.read_checked(d / rel, entry, seen, st) == data
    # a file changed less than RACY_S before its verification gets no identity: it is always hashed again
    (held,) = local_sets.scan_node(node_dir, "node0").sets
    assert rel not in held.seen and held.owners == ["node0", "node1"]
    with pytest.raises(ValueError, match="changed since"):
        local_sets.read_checked(d / rel, {**entry, "sha256": "0" * 64}, None, st)
    # the choice carries each rank's identities to its reader
    ring_of_sets(tmp_path, 8)
    got = local_sets.choose(None, [local_sets.scan_node(LocalPaths(tmp_path, "tiny").node_dir(n), n, clock=later)
                                   for n in ("node0", "node1")], world=4, layout=LAYOUT, identity=IDENTITY)
    assert got.step == 8 and set(got.seen[2]) == set(LocalPaths.shard_files("node1", 2))


def test_sets_of_another_layout_world_or_run_and_uncommitted_ones_are_never_loaded(tmp_path):
    write_set(tmp_path, "node0", 9, ["node0", "node1"], staging=True)  # never committed: not a candidate
    for n in ("node0", "node1"):
        write_set(tmp_path, n, 8, ["node0", "node1"], layout={"tp": 2, "pp": 1, "dp": 2})
        write_set(tmp_path, n, 7, ["node0", "node1"], run={"name": "other", "id": "x"})
    ring_of_sets(tmp_path, 6)
    got = choose(tmp_path, global_step=None)
    assert got.step == 6
    text = " ".join(n["reason"] for n in got.notices)
    assert "same layout only" in text and "written by run 'other'" in text
    assert not any(n["step"] == 9 for n in got.notices)


def test_a_manifest_that_does_not_parse_or_lies_about_its_step_is_skipped(tmp_path):
    d = write_set(tmp_path, "node0", 6, ["node0", "node1"])
    (d / LOCAL_MANIFEST).write_text("{not json")
    d2 = write_set(tmp_path, "node1", 6, ["node1", "node0"])
    doc = json.loads((d2 / LOCAL_MANIFEST).read_text())
    doc["step"] = 7
    (d2 / LOCAL_MANIFEST).write_text(json.dumps(doc))
    got = choose(tmp_path, global_step=2)
    assert got.step is None
    text = " ".join(n["reason"] for n in got.notices)
    assert "manifest.json unreadable" in text and "manifest step 7 != directory step 6" in text


def test_prune_keeps_the_newest_sets_and_removes_staging_and_abandoned_timelines():
    names = [local_set_name(s) for s in (3, 4, 5, 9)] + [local_set_name(2) + ".tmp", local_set_name(5) + ".del",
                                                          "unrelated", local_set_name(5) + ".tmp"]
    assert local_sets.prune_names(names, keep=1, committed=5) == sorted(
        [local_set_name(2) + ".tmp", local_set_name(5) + ".del", local_set_name(9)]) + [local_set_name(4),
                                                                                        local_set_name(3)]
    assert local_set_name(4) not in local_sets.prune_names(names, keep=2, committed=5)
    assert parse_local_set_name("local_0000012.tmp") == (12, ".tmp") and parse_local_set_name("iter_0000012") is None


# ---- the check ------------------------------------------------------------------------------------------------

BASE = ["cluster=local", "model=tiny", "cluster.nodes=2", "cluster.gpus_per_node=2", "run.dir=/nonexistent/runs/t"]


def problems(*overrides, free=10**12):
    return [p for p in check(compose_job([*BASE, *overrides]), free_bytes=lambda _p: free)
            if p.field.startswith(("training.local_checkpoint", "cluster.local_checkpoint_dir"))]


def test_the_local_tier_is_off_by_default_and_two_simulated_nodes_are_a_valid_local_job():
    job = compose_job(BASE)
    assert not job.training.local_checkpoint.enabled and job.cluster.local_checkpoint_dir == ""
    assert check(job, free_bytes=lambda _p: 0) == []


@pytest.mark.parametrize("overrides,field,fragment", [
    (["training.local_checkpoint.interval=-1"], "training.local_checkpoint.interval", "interval = -1"),
    (["training.local_checkpoint.interval=2"], "cluster.local_checkpoint_dir", "local_checkpoint_dir = ''"),
    (["training.local_checkpoint.keep=3"], "training.local_checkpoint.keep", "keep = 3"),
    (["training.local_checkpoint.replication=0"], "training.local_checkpoint.replication", "replication = 0 < 1"),
    (["training.local_checkpoint.interval=2", "cluster.local_checkpoint_dir=/tmp/l",
      "training.local_checkpoint.replication=3"], "training.local_checkpoint.replication",
     "replication 3 > cluster.nodes 2"),
    (["training.local_checkpoint.interval=10", "cluster.local_checkpoint_dir=/tmp/l",
      "training.checkpoint_interval=10"], "training.local_checkpoint.interval", "interval 10 >= training.checkpoint_interval 10"),
])
def test_bad_local_tier_settings_are_one_problem_each(overrides, field, fragment):
    got = problems(*overrides)
    assert [p.field for p in got] == [field], got
    assert fragment in got[0].arithmetic and got[0].fix


@pytest.mark.parametrize("local,fragment", [
    ("/", "a system or shared directory"),
    ("/dev/shm", "a system or shared directory"),
    ("/nonexistent/runs/t/../../../tmp", "which resolves to /tmp"),
    ("/nonexistent/runs/t", "the run directory or inside it"),
    ("/nonexistent/runs/t/local", "the run directory or inside it"),
])
def test_a_local_directory_that_is_shared_or_the_runs_own_is_refused(local, fragment):
    got = problems("training.local_checkpoint.interval=2", f"cluster.local_checkpoint_dir={local}")
    assert [p.field for p in got] == ["cluster.local_checkpoint_dir"], got
    assert fragment in got[0].arithmetic and got[0].fix


def test_a_local_directory_inside_the_run_root_where_other_runs_live_is_refused(tmp_path):
    job = compose_job(["cluster=local", "model=tiny", "cluster.nodes=2", "cluster.gpus_per_node=2",
                       f"cluster.run_root={tmp_path / 'runs'}", "run.name=t", "training.local_checkpoint.interval=2",
                       f"cluster.local_checkpoint_dir={tmp_path / 'runs' / 'other'}"])
    got = [p for p in check(job, free_bytes=lambda _p: 10**12) if p.field == "cluster.local_checkpoint_dir"]
    assert len(got) == 1 and "cluster.run_root or inside it" in got[0].arithmetic


def test_a_local_directory_too_small_for_two_sets_times_the_replication_is_refused_with_the_arithmetic():
    ok = ["training.local_checkpoint.interval=2", "cluster.local_checkpoint_dir=/tmp/l"]
    need = needed_bytes(compose_job([*BASE, *ok]))
    assert problems(*ok, free=int(need) + 1) == []
    got = problems(*ok, free=int(need) - 1)
    assert [p.field for p in got] == ["cluster.local_checkpoint_dir"]
    assert "(keep 1 + 1 being written) x replication 2 x" in got[0].arithmetic
    one_node = compose_job(["cluster=local", "model=tiny", "cluster.gpus_per_node=2", *ok,
                            "run.dir=/nonexistent/runs/t"])
    assert needed_bytes(one_node) == need  # per node: the same ranks per node hold the same shards


# ---- simulated nodes ------------------------------------------------------------------------------------------

def test_cluster_local_groups_its_ranks_into_simulated_nodes():
    envs = [rank_env({"SLURM_JOB_ID": "1"}, r, 4, 29500, 0, "/repo", per_node=2) for r in range(4)]
    assert [e[LOCAL_NODE_ENV] for e in envs] == NODES4
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1"] and envs[0]["LOCAL_WORLD_SIZE"] == "2"
    assert LOCAL_NODE_ENV not in rank_env({}, 0, 4, 29500, 0, "/repo")  # one node: no simulated node names
    assert node_name({LOCAL_NODE_ENV: "node1", "SLURMD_NODENAME": "gpu7"}) == "node1"
    assert node_name({"SLURMD_NODENAME": "gpu7"}) == "gpu7"
    assert node_name({}, hostname=lambda: "login1") == "login1"


def test_a_left_timeline_s_newer_sets_are_abandoned_at_once_and_older_ones_kept():
    names = [local_set_name(s) for s in (4, 6, 8)] + [local_set_name(10) + ".tmp", local_set_name(12) + ".del",
                                                     "notes.txt"]
    # a rollback to step 4: the sets of steps 6 and 8 (committed, newer) are left; staging/garbage are the prune's
    assert local_sets.abandoned_names(names, after=4) == [local_set_name(6), local_set_name(8)]
    assert local_sets.abandoned_names(names, after=8) == []
    # a start over (step 0): every committed set
    assert local_sets.abandoned_names(names, after=0) == [local_set_name(s) for s in (4, 6, 8)]
    # a renamed set is garbage: never a candidate again, and the next commit's prune removes it
    assert parse_local_set_name(local_set_name(6) + ".del") == (6, ".del")
    assert local_set_name(6) + ".del" in local_sets.prune_names([local_set_name(6) + ".del"], keep=1, committed=5)


# ---- room on the compute nodes (the start's probe: a login node cannot see their disks) -------------------

class _Disk(local_sets.LocalStorage):
    """The real filesystem, with a chosen amount free (a full /dev/shm cannot be made safely in a test)."""

    def __init__(self, free: int) -> None:
        self.free = free

    def free_bytes(self, path: Path) -> int:
        assert path.exists(), path  # asked where the directory is, or its nearest existing parent
        return self.free


def test_a_node_s_room_is_the_free_space_plus_what_the_run_s_own_sets_there_take(tmp_path):
    node_dir = tmp_path / "shm" / "node0" / "tiny"
    assert local_sets.node_room(node_dir, _Disk(1000)) == 1000  # not created yet: its parent's filesystem
    (node_dir / "local_0000004").mkdir(parents=True)
    (node_dir / "local_0000004" / "rank_00000.safetensors").write_bytes(b"x" * 300)
    (node_dir / "local_0000004" / "manifest.json").write_bytes(b"{}")
    assert local_sets.node_room(node_dir, _Disk(1000)) == 1302


def test_a_node_without_room_for_the_planned_sets_turns_local_saves_off_with_the_arithmetic(tmp_path):
    from recovery.start import decide_start

    job = compose_job(["model=tiny", "cluster=local", f"run.dir={tmp_path}", "run.name=tiny", "cluster.nodes=2",
                       "cluster.gpus_per_node=2", "training.local_checkpoint.interval=2",
                       f"cluster.local_checkpoint_dir={tmp_path / 'shm'}"])
    paths = job.paths_at(tmp_path)
    from launch.check_local_ckpt import local_plan

    plan = local_plan(job)
    paths.local_plan.write_text(json.dumps(plan))
    need = int(plan["needed_bytes"])
    invs = [local_sets.Inventory("node0", room_bytes=need), local_sets.Inventory("node1", room_bytes=need - 1)]

    def decide(inventories):
        start = decide_start(paths, job, restart=0, job_id=None, env={}, storage=local_sets.LocalStorage(), world=4,
                             layout=LAYOUT, inventories=inventories)
        start.run_lock.release()
        return start

    start = decide(invs)
    assert start.ok and start.local_saves_off, start
    [notice] = [n for n in start.notices if n.get("reason") == "no_space"]
    assert notice["event"] == EventKind.LOCAL_CHECKPOINT_SKIPPED and notice["node"] == "node1"
    assert "local saves are off for this attempt: node node1's local directory" in notice["message"]
    assert plan["arithmetic"] in notice["message"] and "(keep 1 + 1 being written) x replication 2 x" in \
        plan["arithmetic"]
    assert not decide([local_sets.Inventory("node0", room_bytes=need), local_sets.Inventory("node1")]).local_saves_off
    paths.local_plan.unlink()  # no plan (a run submitted before this file existed): nothing to compare with
    assert not decide(invs).local_saves_off


def test_submit_writes_the_space_arithmetic_for_the_ranks_only_when_the_tier_is_on(tmp_path):
    from launch.pretrain import write_local_plan

    on = compose_job(["cluster=local", "cluster.nodes=2", "cluster.gpus_per_node=2",
                      "training.local_checkpoint.interval=2", f"cluster.local_checkpoint_dir={tmp_path / 'shm'}"])
    write_local_plan(on, tmp_path)
    doc = json.loads(on.paths_at(tmp_path).local_plan.read_text())
    assert doc["needed_bytes"] == needed_bytes(on) and doc["replication"] == 2 and doc["keep"] == 1
    write_local_plan(compose_job(["cluster=local"]), tmp_path)  # the tier turned off: no stale plan is left
    assert not on.paths_at(tmp_path).local_plan.exists()
