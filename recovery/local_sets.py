"""The node-local checkpoint tier's rules, torch-free: the ring, the manifest, what each node holds, and the choice
between the newest verified global checkpoint and the newest complete, verified local set.

A *local set* of step S is every rank's shard of the training state at S (``train/local_ckpt.py`` writes them).
Each node ``<local_checkpoint_dir>/<node>/<run.name>/local_S/`` holds its own ranks' shards under ``<node>/`` and
the replicas of the previous ``replication - 1`` nodes of the ring under their names, and one ``manifest.json``
(run identity, step, world size and layout, every rank's node, and the SHA-256 of every file), written and
renamed into place only after every rank agreed (an all-reduce) that every shard and every replica was written.

At the start of an attempt every node verifies what it holds (:func:`scan_node`, per owner node: a flipped byte in
a replica costs that replica, not the node's own shards), rank 0 gathers the inventories and :func:`choose` picks:

* the local set is used only when it is newer than the newest verified global checkpoint (at the same step the
  global one is loaded) and *complete*: every rank's shard verified on some node that is still in the job (its own
  node, or a replica on a peer when a node and its directory are gone);
* a set that is incomplete, fails its SHA-256, belongs to another run, or was saved in another world size or layout
  (local sets restore in the same layout only) is skipped with a notice (a WARNING and a
  ``local_checkpoint_skipped`` event), and the next candidate is tried;
* a local set and a global checkpoint are never mixed: the answer is one source.

Everything here is a pure function over the files found (the storage is injected), so the unit tests need no torch
and no training.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence

from launch.kinds import EventKind
from launch.paths import (
    DELETE_SUFFIX,
    LOCAL_MANIFEST,
    STAGING_SUFFIX,
    LocalPaths,
    local_set_name,
    parse_local_set_name,
)
from recovery import trust
from recovery.storage import HASH_NAME, LocalStorage, digest_key, size_text

FORMAT = "slurmtron-local-checkpoint"
FORMAT_VERSION = 1
# a file whose last change is this recent when it is verified may change again within the same tick of the
# filesystem's clock without a new ctime: its identity is not recorded, and the restore hashes it again
RACY_S = 2.0


# ---- the ring ---------------------------------------------------------------------------------------------

def node_order(rank_nodes: Sequence[str]) -> List[str]:
    """The job's nodes in ring order: by their first rank (``rank_nodes[r]`` is rank r's node)."""
    seen: Dict[str, None] = {}
    for n in rank_nodes:
        seen.setdefault(n, None)
    return list(seen)


def ranks_of(rank_nodes: Sequence[str]) -> Dict[str, List[int]]:
    """node -> its ranks, in rank order."""
    out: Dict[str, List[int]] = {}
    for r, n in enumerate(rank_nodes):
        out.setdefault(n, []).append(r)
    return out


def replica_holders(node: str, nodes: Sequence[str], replication: int) -> List[str]:
    """The nodes that hold copies of ``node``'s shards: the next ``replication - 1`` nodes of the ring."""
    i = list(nodes).index(node)
    n = len(nodes)
    return [nodes[(i + k) % n] for k in range(1, min(max(1, replication), n))]


def exchange_plan(rank_nodes: Sequence[str], replication: int) -> List[tuple[int, int]]:
    """Every (sender rank, receiver rank) of one local save: the rank with the same place on each holder node.

    Needs the same number of ranks on every node (Slurm's tasks per node, ``cluster=local``'s simulated nodes)."""
    by_node = ranks_of(rank_nodes)
    nodes = node_order(rank_nodes)
    sizes = {len(v) for v in by_node.values()}
    if len(sizes) > 1:
        raise ValueError(f"the local tier needs as many ranks on every node: {({n: len(v) for n, v in by_node.items()})}")
    plan = []
    for node in nodes:
        for holder in replica_holders(node, nodes, replication):
            plan += list(zip(by_node[node], by_node[holder]))
    return plan


# ---- the manifest -------------------------------------------------------------------------------------------

def build_manifest(step: int, holder: str, *, run: Optional[dict], world: int, layout: Any,
                   rank_nodes: Sequence[str], files: Mapping[str, tuple[int, str]], now: float,
                   meta: Optional[dict] = None) -> dict:
    """The manifest of ``holder``'s directory of the set of ``step``: ``files`` is {rel: (size, sha256 hex)}."""
    key = digest_key(HASH_NAME)
    return {
        "format": FORMAT, "version": FORMAT_VERSION, "step": int(step), "time": now, "hash": HASH_NAME,
        "holder": holder, "run": run, "world": int(world), "layout": layout, "rank_nodes": list(rank_nodes),
        "meta": meta or {},
        "files": {rel: {"size": int(n), key: d} for rel, (n, d) in sorted(files.items())},
    }


def owner_of(rel: str) -> str:
    """The node whose shard a file of a set is (its first path component)."""
    return rel.split("/", 1)[0]


def verify_set(path: Path, *, storage: Optional[LocalStorage] = None, now: Optional[float] = None,
               seen: Optional[Dict[str, list]] = None
               ) -> tuple[Optional[dict], Dict[str, Optional[str]], Optional[str]]:
    """(manifest, {owner node: None if its files verify, else why}, reason the whole directory is unusable).

    Each file is checked for presence, size and SHA-256 against the manifest, per owner node, so a damaged
    replica does not cost the holder's own shards. ``seen`` (when given) gets each verified file's identity
    (:meth:`LocalStorage.identity`, taken before it was hashed) unless its last change is within :data:`RACY_S`
    of ``now``: while the identity is unchanged the file is the one verified (:func:`read_checked`)."""
    st = storage or LocalStorage()
    parsed = parse_local_set_name(Path(path).name)
    if parsed is None or parsed[1]:
        return None, {}, "not a committed local set"
    try:
        doc = json.loads(st.read_text(Path(path) / LOCAL_MANIFEST))
    except FileNotFoundError:
        return None, {}, "no manifest.json: the save never committed"
    except (OSError, ValueError, UnicodeDecodeError) as e:
        return None, {}, f"manifest.json unreadable: {e}"
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != FORMAT_VERSION:
        return None, {}, f"manifest format {doc.get('format') if isinstance(doc, dict) else doc!r}, expected {FORMAT}"
    if doc.get("step") != parsed[0]:
        return None, {}, f"manifest step {doc.get('step')!r} != directory step {parsed[0]}"
    files = doc.get("files")
    if not isinstance(files, dict) or not files:
        return None, {}, "manifest lists no files"
    key = digest_key(doc.get("hash") or HASH_NAME)
    verdict: Dict[str, Optional[str]] = {}
    now = time.time() if now is None else now
    for rel in sorted(files):
        owner = owner_of(rel)
        if verdict.get(owner):
            continue
        verdict.setdefault(owner, None)
        p = Path(path) / rel
        try:
            size = st.size(p)
        except FileNotFoundError:
            verdict[owner] = f"missing file {rel}"
            continue
        except OSError as e:
            verdict[owner] = f"cannot stat {rel}: {e}"
            continue
        if size != files[rel].get("size"):
            verdict[owner] = f"size mismatch {rel}: {size} bytes on disk, {files[rel].get('size')} in manifest"
            continue
        try:
            ident = st.identity(p)
            _n, digest = st.digest(p, hash_name=doc.get("hash") or HASH_NAME)
        except OSError as e:
            verdict[owner] = f"cannot read {rel}: {e}"
            continue
        if digest != files[rel].get(key):
            verdict[owner] = f"checksum mismatch {rel}: sha256 {digest[:16]}... != manifest {str(files[rel].get(key))[:16]}..."
        elif seen is not None and now - ident[4] / 1e9 > RACY_S:
            seen[rel] = list(ident)
    return doc, verdict, None


# ---- what one node holds --------------------------------------------------------------------------------

@dataclass
class HeldSet:
    """A committed local set on one node, after verification."""

    step: int
    holder: str  # the node whose directory it is
    path: str
    owners: List[str]  # the nodes whose shards verified here
    world: int
    layout: Any
    rank_nodes: List[str]
    files: Dict[str, dict]  # the manifest's files
    meta: dict = field(default_factory=dict)
    run: Optional[dict] = None  # the manifest's owner: run name, id, model shape
    seen: Dict[str, list] = field(default_factory=dict)  # rel -> identity when verified (the loader's check)


@dataclass
class Inventory:
    """What one node's local directory holds for this run (:func:`scan_node`); plain data (gathered to rank 0)."""

    node: str
    sets: List[HeldSet] = field(default_factory=list)
    skipped: List[tuple] = field(default_factory=list)  # (path, step, owner or '', reason)
    room_bytes: Optional[int] = None  # free where the directory is plus what this run's files there take (None: unknown)
    trusted: List[tuple] = field(default_factory=list)  # (path, step, why): others can write it, loaded as trusted


def node_room(node_dir: Path, storage: Optional[LocalStorage] = None) -> Optional[int]:
    """The bytes a node's local directory can hold for this run: the free space of its filesystem (at the nearest
    existing parent: the directory may not exist yet) plus what the run's sets there already take (each is replaced
    as a new one commits). None when the filesystem cannot be asked."""
    st = storage or LocalStorage()
    probe = Path(node_dir)
    while not st.exists(probe) and probe != probe.parent:
        probe = probe.parent
    try:
        free = int(st.free_bytes(probe))
        used = sum(st.size(Path(node_dir) / rel) for rel in st.list_files(node_dir)) if st.is_dir(node_dir) else 0
    except OSError:
        return None
    return free + used


def room_notices(inventories: Iterable[Inventory], plan: Optional[dict], step: Optional[int]) -> list:
    """One notice per node whose local directory cannot hold what the planner says a node needs (``plan``: the
    run's ``local_plan.json``, written at submit); empty when every node has room or nothing is known."""
    if not plan or not isinstance(plan.get("needed_bytes"), (int, float)):
        return []
    need = float(plan["needed_bytes"])
    out = []
    for inv in inventories:
        if inv.room_bytes is None or inv.room_bytes >= need:
            continue
        out.append({"event": EventKind.LOCAL_CHECKPOINT_SKIPPED, "step": step, "path": None, "node": inv.node,
                    "reason": "no_space",
                    "message": f"local saves are off for this attempt: node {inv.node}'s local directory can hold "
                               f"{size_text(inv.room_bytes)} for this run < {plan.get('arithmetic') or size_text(need)}; "
                               f"free space there, choose a larger node-local directory "
                               f"(cluster.local_checkpoint_dir), or lower training.local_checkpoint.replication / "
                               f"keep (the global checkpoints go on)"})
    return out


def scan_node(node_dir: Path, node: str, *, identity: Optional[dict] = None,
              storage: Optional[LocalStorage] = None, clock: Callable[[], float] = time.time,
              trust_shared: bool = False, uid: Optional[int] = None) -> Inventory:
    """Verify every committed local set in ``node_dir`` (SHA-256 of every file); staging and pruned ones are not
    candidates. A set of another run (its manifest's run name or id) is skipped, never loaded.

    The global tier's trust rule holds here too (:mod:`recovery.trust`): a set that another user could have
    written (a file or directory owned by another uid or writable by group or others, on the way from the node's
    directory down, or a symlink into such a place) is skipped: its manifest could have been resealed to choose the
    restored weights and step. The resume then falls back to the global tier (a WARNING and an event).
    ``trust_shared`` (``SLURMTRON_TRUST_SHARED_CHECKPOINTS=1``) loads it anyway, said as a notice."""
    st = storage or LocalStorage()
    inv = Inventory(node)
    if not st.is_dir(node_dir):
        return inv
    for name in st.list_dir(node_dir):
        parsed = parse_local_set_name(name)
        if parsed is None or parsed[1] in (STAGING_SUFFIX, DELETE_SUFFIX):
            continue
        path = Path(node_dir) / name
        try:
            shared = trust.tree_writable_by_others(Path(node_dir), path, uid=uid)
        except OSError as e:
            shared = f"cannot examine {path}: {e.strerror or e}"
        if shared and not trust_shared:
            inv.skipped.append((str(path), parsed[0], "", f"other users could have written it: {shared} "
                                                            f"({trust.TRUST_ENV}=1 loads it anyway)"))
            continue
        if shared:
            inv.trusted.append((str(path), parsed[0], shared))
        seen: Dict[str, list] = {}
        doc, verdict, why = verify_set(path, storage=st, now=clock(), seen=seen)
        if why is not None:
            inv.skipped.append((str(path), parsed[0], "", why))
            continue
        run = doc.get("run") or {}
        why = foreign(run, identity)
        if why:
            inv.skipped.append((str(path), parsed[0], "", why))
            continue
        for owner, reason in sorted(verdict.items()):
            if reason:
                inv.skipped.append((str(path), parsed[0], owner, reason))
        inv.sets.append(HeldSet(step=parsed[0], holder=node, path=str(path),
                                owners=sorted(o for o, r in verdict.items() if r is None),
                                world=int(doc.get("world") or 0), layout=doc.get("layout"),
                                rank_nodes=list(doc.get("rank_nodes") or []), files=doc["files"],
                                meta=doc.get("meta") or {}, run=run or None, seen=seen))
    return inv


# ---- the choice -----------------------------------------------------------------------------------------

@dataclass
class LocalChoice:
    """The start's answer about the local tier: ``step`` None = resume from the global tier (or start)."""

    step: Optional[int] = None
    sources: Dict[int, tuple] = field(default_factory=dict)  # rank -> (holder node, path of the set, owner node)
    files: Dict[int, Dict[str, dict]] = field(default_factory=dict)  # rank -> {rel: manifest entry} of its 2 files
    seen: Dict[int, Dict[str, list]] = field(default_factory=dict)  # rank -> {rel: identity when verified}
    meta: dict = field(default_factory=dict)
    notices: list = field(default_factory=list)  # each a WARNING and a local_checkpoint_skipped event
    global_step: Optional[int] = None  # the newest verified global checkpoint's step it was weighed against


def _notice(path: str, step: int, owner: str, reason: str, what: str) -> dict:
    return {"event": EventKind.LOCAL_CHECKPOINT_SKIPPED, "step": step, "path": path, "node": owner or None,
            "reason": reason, "message": f"skipping the local set of step {step} ({what}): {reason}"}


def foreign(run: Optional[dict], identity: Optional[dict]) -> Optional[str]:
    """Why a set whose manifest names ``run`` is not this run's (``identity``: name, id), or None."""
    if identity is None:
        return None
    run = run or {}
    if run.get("name") != identity.get("name") or (identity.get("id") and run.get("id") != identity.get("id")):
        return f"written by run {run.get('name')!r} (id {run.get('id')}), this is run {identity.get('name')!r} " \
               f"(id {identity.get('id')})"
    return None


def choose(global_step: Optional[int], inventories: Iterable[Inventory], *, world: int, layout: Any,
           identity: Optional[dict] = None) -> LocalChoice:
    """The newest complete, verified local set newer than ``global_step`` (None: no global checkpoint), or none.

    A set is complete when every rank's shard verified on a node of this job; each rank reads from its own node's
    copy when that verified, else from a replica. Every set passed over, and every damaged copy of a set newer than
    the global checkpoint, is a notice."""
    invs = list(inventories)
    floor = -1 if global_step is None else int(global_step)
    out = LocalChoice(global_step=global_step)
    for inv in invs:
        for path, step, owner, reason in inv.skipped:
            if step > floor:
                out.notices.append(_notice(path, step, owner, reason, f"on node {inv.node}" +
                                           (f", the copy of node {owner}'s shards" if owner else "")))
        for path, step, why in inv.trusted:
            if step > floor:
                out.notices.append({"event": EventKind.SHARED_CHECKPOINT_TRUSTED, "step": step, "path": path,
                                    "reason": "trusted_by_env",
                                    "message": f"the local set of step {step} on node {inv.node} may be loaded "
                                               f"although other users could have written it ({why}): "
                                               f"{trust.TRUST_ENV}=1 trusts it"})
    by_step: Dict[int, List[HeldSet]] = {}
    for inv in invs:
        for s in inv.sets:
            by_step.setdefault(s.step, []).append(s)
    for step in sorted((s for s in by_step if s > floor), reverse=True):
        held = []
        for h in by_step[step]:
            why = foreign(h.run, identity)
            if why:
                out.notices.append(_notice(h.path, step, "", why, f"on node {h.holder}"))
            else:
                held.append(h)
        if not held:
            continue
        first = held[0]
        if any(h.world != first.world or h.layout != first.layout or h.rank_nodes != first.rank_nodes for h in held):
            out.notices.append(_notice(first.path, step, "", "its nodes' manifests disagree on the world or layout",
                                       "all nodes"))
            continue
        if first.world != world or first.layout != layout:
            out.notices.append(_notice(first.path, step, "", f"saved with world {first.world} layout {first.layout}, "
                                       f"this attempt runs world {world} layout {layout} (a local set restores in "
                                       f"the same layout only)", "all nodes"))
            continue
        where: Dict[str, HeldSet] = {}
        for h in held:  # a node's own copy wins over a replica
            for owner in h.owners:
                if owner == h.holder or owner not in where:
                    where[owner] = h
        missing = sorted(set(first.rank_nodes) - set(where))
        if missing:
            have = ", ".join(sorted(h.holder for h in held))
            out.notices.append(_notice(first.path, step, missing[0], f"no verified copy of the shards of node(s) "
                                       f"{', '.join(missing)} (verified copies of this step are held by: {have})",
                                       "incomplete"))
            continue
        out.step = step
        out.meta = dict(first.meta)
        for rank, owner in enumerate(first.rank_nodes):
            h = where[owner]
            rels = LocalPaths.shard_files(owner, rank)
            out.sources[rank] = (h.holder, h.path, owner)
            out.files[rank] = {rel: h.files[rel] for rel in rels}
            out.seen[rank] = {rel: h.seen[rel] for rel in rels if rel in h.seen}
        return out
    return out


def fetch_plan(choice: LocalChoice, rank_nodes_now: Sequence[str]) -> Dict[int, Optional[int]]:
    """rank -> None (it reads its shard from its own node's directory) or the rank that reads it there and sends it
    (a rank on the holder node, the same place among its node's ranks when it can)."""
    by_node = ranks_of(rank_nodes_now)
    plan: Dict[int, Optional[int]] = {}
    for rank, (holder, _path, _owner) in sorted(choice.sources.items()):
        if rank_nodes_now[rank] == holder:
            plan[rank] = None
            continue
        there = by_node.get(holder) or []
        if not there:
            raise ValueError(f"node {holder} holds rank {rank}'s shard but runs no rank of this attempt")
        mine = by_node[rank_nodes_now[rank]]
        place = mine.index(rank) if rank in mine else 0
        plan[rank] = there[place % len(there)]
    return plan


# ---- a node's save, commit and prune (its first rank; every step through the storage seam) -------------------

def sha256_of(data: Any) -> str:
    """SHA-256 of bytes or a uint8 array (its buffer, not a copy): what a manifest records."""
    return hashlib.new(HASH_NAME, memoryview(data)).hexdigest()


def read_checked(path: Path, entry: dict, seen: Optional[list], storage: LocalStorage) -> bytes:
    """A file of the chosen set, as verified at the start: when its identity before and after the read is still
    the one the start's verification saw (``seen``), the start's SHA-256 stands; otherwise (changed since, or no
    identity recorded) its size and SHA-256 are checked against the manifest ``entry`` again. Raises ValueError
    for a file that changed, OSError for one that cannot be read."""
    before = list(storage.identity(path))
    data = storage.read_bytes(path)
    if seen is not None and before == list(seen) == list(storage.identity(path)) and len(data) == entry.get("size"):
        return data
    if len(data) != entry.get("size") or sha256_of(data) != entry.get(digest_key(HASH_NAME)):
        raise ValueError(f"{path} changed since the start verified it (sha256 differs)")
    return data


def begin_set(paths: LocalPaths, node: str, step: int, storage: LocalStorage) -> Path:
    """A fresh staging directory for ``node``'s set of ``step``: a stale staging directory, or a committed set of the
    same step left by a timeline the run abandoned, is removed first."""
    staging = paths.staging(node, step)
    for stale in (staging, paths.set_dir(node, step)):
        storage.remove_tree(stale)
    storage.makedirs(staging)
    return staging


def write_files(staging: Path, files: Mapping[str, Any], storage: LocalStorage, *,
                hashed: bool = True) -> Dict[str, tuple]:
    """Write and fsync each of ``files`` ({rel: bytes}) under ``staging``: {rel: (size, sha256)}, the SHA-256 None
    when not ``hashed`` (a replica: its sender hashed the same bytes). Raises OSError."""
    out: Dict[str, tuple] = {}
    for rel, data in files.items():
        path = Path(staging) / rel
        storage.makedirs(path.parent)
        storage.write_bytes(path, data)
        out[rel] = (len(data), sha256_of(data) if hashed else None)
    return out


def commit_set(paths: LocalPaths, node: str, step: int, staging: Path, manifest: dict, *, keep: int,
               storage: LocalStorage) -> None:
    """Make ``staging`` the committed set of ``step`` on ``node`` (its files and directories fsynced, the manifest
    written last, one rename, the parent fsynced), then prune: the newest ``keep`` sets stay."""
    for d in storage.list_subdirs(staging):
        storage.fsync_dir(d)
    storage.write_text(Path(staging) / LOCAL_MANIFEST, json.dumps(manifest, indent=1))
    storage.fsync_dir(staging)
    storage.rename(staging, paths.set_dir(node, step))
    storage.fsync_dir(paths.node_dir(node))
    prune_sets(paths.node_dir(node), keep=keep, committed=step, storage=storage)


def prune_sets(node_dir: Path, *, keep: int, committed: int, storage: LocalStorage) -> None:
    """Delete what :func:`prune_names` names. A committed set is first renamed to its garbage name (and the rename
    made durable), so a crash inside the deletion never leaves a half-deleted set under a committed name."""
    doomed, renamed = [], False
    for name in prune_names(storage.list_dir(node_dir), keep=keep, committed=committed):
        parsed = parse_local_set_name(name)
        if parsed is not None and not parsed[1]:
            garbage = name + DELETE_SUFFIX
            storage.remove_tree(Path(node_dir) / garbage)
            storage.rename(Path(node_dir) / name, Path(node_dir) / garbage)
            doomed.append(garbage)
            renamed = True
        elif name not in doomed:
            doomed.append(name)
    if renamed:
        storage.fsync_dir(node_dir)
    for name in doomed:
        storage.remove_tree(Path(node_dir) / name)


# ---- keeping 1-2 sets -----------------------------------------------------------------------------------

def prune_names(names: Iterable[str], *, keep: int, committed: int) -> List[str]:
    """What a node deletes after committing the set of step ``committed``: committed sets beyond the newest
    ``keep``, sets newer than it (left by an abandoned timeline: the attempt resumed from an older source), staging
    and half-pruned directories of other steps. Never the set just committed."""
    sets, junk = [], []
    for name in names:
        parsed = parse_local_set_name(name)
        if parsed is None:
            continue
        step, suffix = parsed
        if suffix:
            if step != committed or suffix == DELETE_SUFFIX:
                junk.append(name)
        elif step > committed:
            junk.append(name)
        else:
            sets.append(step)
    sets.sort(reverse=True)
    old = [local_set_name(s) for s in sets[max(1, keep):]]
    return sorted(junk) + old


def abandoned_names(names: Iterable[str], *, after: int) -> List[str]:
    """The committed local sets newer than step ``after`` among a node directory's ``names``: a timeline the run
    left (a NaN or replay rollback, a start over, a resume from an older source). A crash before the next local
    save must not resume from one of them, so they are renamed to the prune's garbage name at once."""
    out = []
    for name in names:
        parsed = parse_local_set_name(name)
        if parsed is not None and not parsed[1] and parsed[0] > int(after):
            out.append(name)
    return sorted(out)
