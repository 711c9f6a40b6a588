"""The node-local checkpoint tier on the ranks: every ``training.local_checkpoint.interval`` steps each rank writes its
own shard of the training state to its node's local directory and sends it to the ranks of the next
``replication - 1`` nodes of a ring; a start restores from the newest complete, verified local set when it is newer
than the newest global checkpoint (the rules: :mod:`recovery.local_sets`; the paths: :class:`launch.paths.LocalPaths`).

What a shard holds, and how it is restored: :mod:`train.local_shard`.

Why not NVRx's local checkpointing (nvidia-resiliency-ext 0.4.1, ``CliqueReplicationStrategy``): its exchange moves
every tensor through CUDA (``ten.cuda()`` in ``group_utils.isend_state_dict`` / ``irecv_state_dict``), so it
cannot run on CPU/gloo, and it sends and reloads the state dict with pickle (``send_object_list``,
``torch.load(weights_only=False)`` of the local files). The ring here is small: gloo ``isend``/``recv`` of byte
tensors over the training process group, never the shared filesystem.

A save stalls training only while this rank's state is copied; the write, the ring (one exchange per peer), the
agreement and the commit run on a thread over a gloo group of the tier's own (host memory, so the same code runs
beside NCCL), one save in flight at a time, its outcome reported at a later step boundary. It never replaces a
global checkpoint: the stop, the final save and a requeue across allocations always write the global tier (the
save in flight is finished first). A failed local save is a WARNING and a ``local_checkpoint_skipped`` event, and
training goes on (the global tier is the durable one).
"""
from __future__ import annotations

import json
import threading
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from safetensors.torch import save as st_save

from launch.dist_env import node_name
from launch.kinds import EventKind
from launch.paths import DELETE_SUFFIX, LocalPaths, local_set_name
from recovery import local_sets
from recovery.trust import trusts_shared
from recovery.events import read_events
from recovery.resume import Resume
from recovery.start import Start
from train.checkpointer import Checkpointer
from train.context import RankContext, gather
from train.local_shard import restore_shard, shard_state, shard_views
from train.train_loop import TrainState


def enabled(job: Any) -> bool:
    return bool(job.training.local_checkpoint.enabled and job.cluster.local_checkpoint_dir)


def local_paths(job: Any) -> LocalPaths:
    return LocalPaths(Path(job.cluster.local_checkpoint_dir), job.run.name)


def all_gather(obj: Any, group: Any = None) -> List[Any]:
    """Every rank's ``obj`` on every rank (in-memory objects of this job only, never a file)."""
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def rank_nodes(ctx: RankContext) -> List[str]:
    """Every rank's node, in rank order (a collective)."""
    return all_gather(node_name(ctx.env))


# ---- the exchange -------------------------------------------------------------------------------------------

def _as_tensor(blob: Any) -> torch.Tensor:
    """A uint8 tensor over ``blob``'s bytes without a copy (gloo only reads it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that a bytes object is not writable: nothing writes it
        return torch.frombuffer(blob, dtype=torch.uint8) if len(blob) else torch.empty(0, dtype=torch.uint8)


def exchange(payloads: Dict[int, List[bytes]], receive_from: List[int], group: Any) -> Dict[int, List[Any]]:
    """Send ``payloads`` ({receiver rank: [blob, ...]}) and receive the blobs of each rank in ``receive_from`` (as
    uint8 numpy arrays, not copied again), over the process group: every send is posted first, so a ring never
    deadlocks. A header with the blobs' lengths precedes them; an empty blob is not sent."""
    pending = []
    for dst, blobs in sorted(payloads.items()):
        header = torch.tensor([len(b) for b in blobs], dtype=torch.int64)
        count = torch.tensor([len(blobs)], dtype=torch.int64)
        pending += [(dist.isend(count, dst, group=group), count), (dist.isend(header, dst, group=group), header)]
        for b in blobs:
            if len(b):
                body = _as_tensor(b)
                pending.append((dist.isend(body, dst, group=group), body))
    got: Dict[int, List[Any]] = {}
    for src in receive_from:
        count = torch.empty(1, dtype=torch.int64)
        dist.recv(count, src, group=group)
        header = torch.empty(int(count.item()), dtype=torch.int64)
        dist.recv(header, src, group=group)
        blobs = []
        for n in header.tolist():
            body = torch.empty(int(n), dtype=torch.uint8)
            if n:
                dist.recv(body, src, group=group)
            blobs.append(body.numpy())
        got[src] = blobs
    for work, _buf in pending:
        work.wait()
    return got


# ---- the tier -----------------------------------------------------------------------------------------------

class LocalRestoreFailed(Exception):
    """Raised on every rank alike: a file of the chosen local set failed its check while it was read."""


class LocalTier:
    """One rank's part of the local tier (every method is collective: every rank calls it)."""

    def __init__(self, ctx: RankContext, parts: Any, nodes: List[str], identity: Optional[dict] = None,
                 saves_off: Optional[str] = None) -> None:
        self.ctx = ctx
        self.parts = parts
        self.cfg = ctx.job.training.local_checkpoint
        self.paths = local_paths(ctx.job)
        self.rank_nodes = nodes
        self.node = nodes[ctx.rank]
        self.leader = local_sets.ranks_of(nodes)[self.node][0] == ctx.rank  # writes its node's manifest
        self.plan = local_sets.exchange_plan(nodes, self.cfg.replication)
        self.identity = identity
        self.saved: set[int] = set()
        self.saves_off = saves_off  # the start found a node's directory too small: restores only, no saves
        # the ring, the agreements and the restore run on a gloo group of their own: host memory (beside NCCL on
        # GPUs), and a save's thread never meets the training's collectives on the default group
        self.group = dist.new_group(backend="gloo")
        self.inflight: Optional[tuple] = None  # (thread, outcome, step, stall seconds) of the save in flight
        self.pinned: Dict[str, torch.Tensor] = {}  # GPU runs: the host buffers every save copies into

    def due(self, step: int, iters: int, global_interval: Optional[int], global_saved: set) -> bool:
        """A local save at ``step``: on the local interval, before the last step, and not where a global save is."""
        if self.saves_off or step <= 0 or step >= iters or step % self.cfg.interval or step in self.saved \
                or step in global_saved:
            return False
        return not (global_interval and step % global_interval == 0)

    def save(self, state: Any) -> None:
        """Start the local save of ``state``'s step. Here, on the training thread, only this rank's state is copied
        (the stall); the write, the ring, the agreement and the commit run on a thread of their own over the tier's
        gloo group while training goes on (:meth:`_write_set`). One save is in flight at a time: the previous one is
        finished first. Its outcome is reported at the next step boundary (:meth:`poll`)."""
        self.wait()
        ctx, step = self.ctx, state.step
        t0 = ctx.clock()
        ctx.beat("save", step)
        tensors, doc = shard_state(self.parts, state, self.pinned)
        doc["rank"], doc["node"] = ctx.rank, self.node
        meta = {"step": step, "consumed_samples": state.consumed_samples}
        stall = ctx.clock() - t0
        ctx.beat("saved", step, stall)
        self.saved.add(step)
        out: Dict[str, Any] = {}
        thread = threading.Thread(target=self._write_set, args=(step, tensors, doc, meta, t0, out),
                                  name=f"local-save-{step}", daemon=True)
        thread.start()
        self.inflight = (thread, out, step, stall)

    def poll(self) -> None:
        """At a step boundary: report a save whose thread has ended (no collective)."""
        if self.inflight is not None and not self.inflight[0].is_alive():
            self._report()

    def wait(self, timeout: Optional[float] = None) -> None:
        """Finish the save in flight (at most ``timeout`` seconds) and report it."""
        if self.inflight is None:
            return
        self.inflight[0].join(timeout)
        if self.inflight[0].is_alive():
            step = self.inflight[2]
            self.inflight = None
            self._skipped(step, f"its write was still running after {timeout:g} s when this attempt ended")
            return
        self._report()

    def _report(self) -> None:
        _thread, out, step, stall = self.inflight
        self.inflight = None
        ctx = self.ctx
        if not out.get("ok"):
            self._skipped(step, out.get("problem") or "its write ended without an outcome")
            return
        nodes = len(set(self.rank_nodes))
        ctx.emit(EventKind.LOCAL_CHECKPOINT_SAVED, step=step, seconds=out["seconds"], stall_s=stall,
                 bytes=out["bytes"], nodes=nodes, replication=self.cfg.replication, sent_bytes=out["sent_bytes"])
        ctx.log(f"  local checkpoint of iteration {step:7d} on {nodes} node(s), replication {self.cfg.replication} "
                f"({out['seconds']:.2f} s in the background, {stall:.2f} s of training)")

    def _skipped(self, step: int, why: str) -> None:
        self.saved.discard(step)
        msg = f"the local checkpoint of iteration {step} failed ({why}); training goes on, the global tier is intact"
        self.ctx.emit(EventKind.LOCAL_CHECKPOINT_SKIPPED, step=step, path=str(self.paths.staging(self.node, step)),
                      node=self.node, reason="save_failed", detail=msg[:2000])
        self.ctx.log(f"WARNING: {msg}")

    def _write_set(self, step: int, tensors: Dict[str, torch.Tensor], doc: dict, meta: dict, t0: float,
                   out: Dict[str, Any]) -> None:
        """The save's thread: write this rank's shard, send it to the ring and write what arrives, agree (every file
        written whole), commit (each node's leader), agree again. Every collective
        is on the tier's own group, so none meets the training's. The outcome goes to ``out``."""
        try:
            self._write_set_in(step, tensors, doc, meta, t0, out)
        except BaseException as e:  # a peer gone mid-exchange: this set is not committed anywhere
            out["ok"], out["problem"] = False, f"{type(e).__name__}: {e}"

    def _write_set_in(self, step: int, tensors: Dict[str, torch.Tensor], doc: dict, meta: dict, t0: float,
                      out: Dict[str, Any]) -> None:
        ctx, st, group = self.ctx, self.ctx.storage, self.group
        staging = self.paths.staging(self.node, step)
        error = None
        if self.leader:
            try:
                local_sets.begin_set(self.paths, self.node, step, st)
            except OSError as e:
                error = f"{type(e).__name__}: {e}"
        dist.barrier(group=group)
        t_bytes, j_bytes = st_save(tensors), json.dumps(doc, sort_keys=True).encode()
        del tensors
        own_rels = LocalPaths.shard_files(self.node, ctx.rank)
        written: Dict[str, tuple] = {}
        if error is None:
            error = self._write(staging, {own_rels[0]: t_bytes, own_rels[1]: j_bytes}, written)
        sends = {dst: [t_bytes, j_bytes] for src, dst in self.plan if src == ctx.rank}
        sources = [src for src, dst in self.plan if dst == ctx.rank]
        got = exchange(sends, sources, group)
        for src in list(got):
            tb, jb = got.pop(src)
            rels = LocalPaths.shard_files(self.rank_nodes[src], src)
            if error is None:  # not hashed again: the sender's SHA-256 goes into the manifest, and a start
                error = self._write(staging, {rels[0]: tb, rels[1]: jb}, written, hashed=False)  # checks it
            del tb, jb
        own = {rel: tuple(written[rel]) if rel in written else (len(b), local_sets.sha256_of(b))  # hashed once
               for rel, b in zip(own_rels, (t_bytes, j_bytes))}
        reports = all_gather({"rank": ctx.rank, "node": self.node, "error": error, "own": own, "written": written},
                             group)
        problem = self._agree(reports)
        committed = 0
        if problem is None and self.leader:
            try:
                owned = {rel: tuple(v) for r in reports for rel, v in r["own"].items()}
                mine = {rel: owned[rel] for r in reports if r["node"] == self.node for rel in r["written"]}
                self._commit(staging, step, mine, meta)
                committed = 1
            except OSError as e:
                problem = f"node {self.node} could not commit: {type(e).__name__}: {e}"
        flag = torch.tensor([0 if problem else 1], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)  # every node committed (or none is complete)
        out.update(bytes=len(t_bytes) + len(j_bytes), sent_bytes=sum(len(b) for v in sends.values() for b in v),
                   seconds=ctx.clock() - t0)
        if int(flag.item()) == 1:
            out["ok"] = True
            return
        if self.leader and not committed:
            try:
                st.remove_tree(staging)
            except OSError:
                pass
        out["ok"], out["problem"] = False, problem or "another node could not commit its local set"

    def _write(self, staging: Path, files: Dict[str, Any], written: Dict[str, tuple], *,
               hashed: bool = True) -> Optional[str]:
        """Write and fsync ``files`` under ``staging``; the error as text (the exchange goes on either way)."""
        try:
            written.update(local_sets.write_files(staging, files, self.ctx.storage, hashed=hashed))
            return None
        except OSError as e:
            return f"{type(e).__name__}: {e}"

    def _agree(self, reports: List[dict]) -> Optional[str]:
        """Every rank computes the same verdict from the same reports: every write succeeded, and every file written
        is one a rank sent, whole (the sender's size; the transport checked the bytes, and every start checks each
        file's SHA-256 against the manifest before it uses the set)."""
        for r in reports:
            if r["error"]:
                return f"rank {r['rank']} on {r['node']}: {r['error']}"
        owned = {rel: tuple(v) for r in reports for rel, v in r["own"].items()}
        for r in reports:
            for rel, (size, digest) in r["written"].items():
                want = owned.get(rel)
                if want is None or size != want[0] or digest not in (None, want[1]):
                    return f"rank {r['rank']} on {r['node']} wrote {rel} unlike its sender's ({size} bytes, sha256 " \
                           f"{str(digest)[:16]}; sent: {want})"
        return None

    def _commit(self, staging: Path, step: int, files: Dict[str, tuple], meta: dict) -> None:
        doc = local_sets.build_manifest(
            step, self.node, run=self.identity, world=self.ctx.world, layout=self.ctx.layout,
            rank_nodes=self.rank_nodes, files=files, now=time.time(), meta=meta)
        local_sets.commit_set(self.paths, self.node, step, staging, doc, keep=self.cfg.keep, storage=self.ctx.storage)

    def abandon_after(self, step: int, why: str) -> None:
        """Every rank (collective): the local sets newer than ``step`` belong to a timeline the run just left
        (``why``); each node's first rank renames them to the prune's garbage name (removed at the next commit),
        so a crash before the next local save resumes from the newest source of *this* timeline; rank 0 says so
        (a WARNING and a ``local_checkpoint_skipped`` event per set). A save in flight is finished first."""
        self.wait()
        st, gone = self.ctx.storage, []
        node_dir = self.paths.node_dir(self.node)
        if self.leader and st.is_dir(node_dir):
            for name in local_sets.abandoned_names(st.list_dir(node_dir), after=step):
                st.rename(node_dir / name, node_dir / (name + DELETE_SUFFIX))
                gone.append([str(node_dir / name), local_sets.parse_local_set_name(name)[0], self.node])
            if gone:
                st.fsync_dir(node_dir)
        self.saved = {s for s in self.saved if s <= step}
        got = gather(gone)
        for path, at, node in (p for ps in (got or []) for p in ps):
            self.ctx.log(f"WARNING: skipping the local set of step {at} on node {node} from now on: {why}")
            self.ctx.emit(EventKind.LOCAL_CHECKPOINT_SKIPPED, step=at, path=path, node=node,
                          reason="abandoned_timeline", detail=why)

    # ---- restore --------------------------------------------------------------------------------------------

    def restore(self, choice: Any) -> dict:
        """Every rank: its shard from the chosen set (read here, or sent by a rank on the node that holds it),
        each file the one the start verified against the holder's manifest; the training state to go on from.

        Every file is read and checked before anything is sent or copied, and the ranks agree on the outcome: when
        any file fails (changed or gone since the start verified the set), every rank raises the same
        :class:`LocalRestoreFailed` and the model is untouched."""
        ctx = self.ctx
        plan = local_sets.fetch_plan(choice, self.rank_nodes)
        mine = plan[ctx.rank]
        sends: Dict[int, List[bytes]] = {}
        own: List[bytes] = []
        error = None
        try:
            for rank, sender in plan.items():
                if sender == ctx.rank:
                    sends[rank] = self._read(choice, rank)
            if mine is None:
                own = self._read(choice, ctx.rank)
        except (OSError, ValueError) as e:
            error = f"rank {ctx.rank} on {self.node}: {e}"
        errors = [e for e in all_gather(error, self.group) if e]
        if errors:
            raise LocalRestoreFailed("; ".join(errors))
        got = exchange(sends, [] if mine is None else [mine], self.group)
        del sends
        tb, jb = own if mine is None else got.pop(mine)
        doc = json.loads(bytes(jb).decode())
        return restore_shard(self.parts, shard_views(tb), doc)

    def _read(self, choice: Any, rank: int) -> List[bytes]:
        """Rank ``rank``'s two files (tensors, JSON) from the chosen set on this node, each the file the start
        verified (:func:`recovery.local_sets.read_checked`: unchanged since, or its SHA-256 checked again). Raises
        ValueError (a changed file, a tensor header that does not describe its data) or OSError."""
        _holder, set_path, owner = choice.sources[rank]
        seen = choice.seen.get(rank) or {}
        files = [local_sets.read_checked(Path(set_path) / rel, choice.files[rank][rel], seen.get(rel), self.ctx.storage)
                 for rel in LocalPaths.shard_files(owner, rank)]
        shard_views(files[0])  # a header that does not describe its data: refused here, before the ranks agree
        return files


# ---- the start ----------------------------------------------------------------------------------------------

def gather_inventories(ctx: RankContext) -> Optional[tuple]:
    """Every rank (collective, when the tier is on): each node's first rank verifies its node's local directory;
    rank 0 gets (rank nodes, inventories), the others (rank nodes, None). None when the tier is off."""
    if not enabled(ctx.job):
        return None
    nodes = rank_nodes(ctx)
    node = nodes[ctx.rank]
    inv = None
    if local_sets.ranks_of(nodes)[node][0] == ctx.rank:
        node_dir = local_paths(ctx.job).node_dir(node)
        found = local_sets.scan_node(node_dir, node, storage=ctx.storage, trust_shared=trusts_shared(ctx.env))
        found.room_bytes = local_sets.node_room(node_dir, ctx.storage)
        inv = asdict(found)
    got = gather(inv)
    return nodes, (None if got is None else [local_sets.Inventory(
        i["node"], [local_sets.HeldSet(**s) for s in i["sets"]], [tuple(x) for x in i["skipped"]], i["room_bytes"],
        [tuple(x) for x in i["trusted"]])
        for i in got if i is not None])


def tier_for(ctx: RankContext, parts: Any, start: Start) -> Optional[LocalTier]:
    """The local tier of this attempt (None when it is off)."""
    nodes = getattr(start, "local_nodes", None)
    return LocalTier(ctx, parts, nodes, start.identity, saves_off=start.local_saves_off) if nodes else None


def _last_logged_step(ctx: RankContext) -> Optional[int]:
    """Rank 0: the last step an earlier attempt logged (what an interruption lost is counted from)."""
    steps = [e.get("step") for e in read_events(ctx.paths.events) if e.get("event") == EventKind.ITERATION]
    steps = [s for s in steps if isinstance(s, int)]
    return max(steps) if steps else None


def load_start(ctx: RankContext, ckpt: Checkpointer, start: Start, tier: Optional[LocalTier]) -> Any:
    """Every rank: the training state from the source the start chose (a local set, the global checkpoint, or
    nothing), and a ``resumed_from`` event (rank 0) naming the tier and the steps the interruption lost."""
    local = getattr(start, "local", None)
    last = _last_logged_step(ctx) if ctx.is_first else None
    global_step = (local.global_step if local is not None else start.resume.step)
    resume = start.resume
    state = None
    if tier is not None and local is not None and local.step is not None:
        t0 = ctx.clock()
        ctx.beat("load", local.step)
        holders = sorted({h for h, _p, _o in local.sources.values()})
        where = f"{local_set_name(local.step)} on node(s) {', '.join(holders)}"
        ctx.log(f"loading the local checkpoint {where} at iteration {local.step}")
        ctx.hooks.hold_local_restore(ctx.sleep)
        try:
            ts = tier.restore(local)
        except LocalRestoreFailed as e:  # every rank alike: back to the global checkpoint the set was weighed against
            resume = start.fallback or Resume(None, None)
            to = (f"the global checkpoint of step {resume.step}" if resume.path else
                  "step 0 (no global checkpoint was committed before it)")
            msg = f"the local set {where} failed its check while it was read ({e}); resuming from {to} instead"
            ctx.log(f"WARNING: {msg}")
            ctx.emit(EventKind.LOCAL_CHECKPOINT_SKIPPED, step=local.step, path=where, node=None,
                     reason="changed_after_verification", detail=msg[:2000])
        else:
            state = TrainState(step=int(ts["step"]), consumed_samples=int(ts["consumed_samples"]),
                               skips=[list(x) for x in ts.get("data_skips") or []])
            tier.saved.add(state.step)
            seconds = ctx.clock() - t0
            ctx.log(f"  successfully loaded the local checkpoint {where} at iteration {state.step} ({seconds:.2f} s)")
            ctx.emit(EventKind.RESUME, step=state.step, checkpoint=f"local:{where}",
                     consumed_samples=state.consumed_samples, from_layout=ctx.layout, seconds=seconds)
            tier_name, source = "local", where
    if state is None:
        state = ckpt.load(resume)
        tier_name = "global" if resume.path else "none"
        source = str(resume.path) if resume.path else None
    if tier is not None:  # a start over or a resume from an older source leaves the sets newer than it
        tier.abandon_after(state.step, f"this attempt resumed from the {tier_name} tier at step {state.step}")
    if ctx.is_first and (state.step > 0 or last is not None):
        ctx.emit(EventKind.RESUMED_FROM, tier=tier_name, step=state.step, source=source, global_step=global_step,
                 lost_steps=max(0, last - state.step) if last is not None else 0)
    return state
