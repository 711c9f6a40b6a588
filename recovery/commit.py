"""The checkpoint commit protocol: a checkpoint either exists completely and verified, or not at all.

Every rank writes its shards (Megatron-Core ``dist_checkpointing``) into a *staging*
directory ``<root>/iter_NNNNNNN.tmp``. When all ranks are done (a barrier in the worker),
rank 0 alone calls :func:`commit`, which:

1. fsyncs every file (torch's ``FileSystemWriter`` already fsyncs its own files on each
   rank; doing it again on rank 0 costs little and also covers ``common.pt`` and anything
   written without ``sync_files``), hashing each on the way (several threads: hashlib
   releases the GIL), then fsyncs every directory of the staging tree;
2. writes ``manifest.json`` (format version, step, the worker's ``meta``, and per file its
   size and SHA-256 digest; see :func:`recovery.storage.new_hasher` for why SHA-256; version-1
   manifests carry BLAKE2b-256 digests and are verified with those) and fsyncs it and the
   staging directory;
3. if ``iter_NNNNNNN`` already exists (an earlier attempt saved the same step, then its
   successor was found corrupt or the run was rewound), moves it aside to
   ``iter_NNNNNNN.old`` first: POSIX cannot rename a directory over a non-empty one;
4. renames staging -> ``iter_NNNNNNN`` atomically and fsyncs the parent;
5. removes the ``.old`` copy (a kill before that leaves it; resume loads it if the final name
   is missing, and the next save renames it back, :func:`restore_set_aside`);
6. only then points ``<root>/latest`` at it (write ``latest.tmp``, fsync, rename, fsync);
7. prunes to the newest ``keep`` checkpoints whose manifest checks out (never the one
   ``latest`` names, never the one just written), and stale ``.tmp``/``.old`` leftovers.
   Only checkpoints older than the newest verified one are ever deleted; a damaged one is
   moved to ``quarantine/`` (:mod:`recovery.quarantine`), never deleted; a deletion is a
   rename to ``iter_N.del`` first, so a kill during it cannot leave a half-deleted
   checkpoint under a loadable name. A storage error during the prune (EACCES, EIO, ...)
   stops the prune, not the save: the new checkpoint is already durable
   (:attr:`CommitResult.prune_error`).

The manifest also says whose checkpoint it is (``run``: run name, run id, model shape), so a
resume can refuse another run's checkpoint whatever the paths say.

A crash between any two of these steps leaves either the previous state or the new one:
:func:`recovery.resume.find_latest_verified` only considers ``iter_NNNNNNN`` directories with
a manifest whose files all check out, and treats ``latest`` as a hint. Torn saves (a kill
during step 1 or 2) stay under ``.tmp`` and are never loaded; ``tests/test_recovery_commit.py``
crashes the protocol after every single storage operation to show it.

No torch here: the login node and the analysis tools verify checkpoints too.
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from launch.paths import (  # noqa: F401  (re-exported: the names of the commit protocol)
    ASIDE_SUFFIX, DELETE_SUFFIX, LATEST, MANIFEST, STAGING_SUFFIX, checkpoint_name, parse_checkpoint_name,
)
from recovery.quarantine import quarantine
from recovery.storage import BLAKE2B_NAME, HASH_NAME, HASHES, LocalStorage, StorageError, classify, digest_key

FORMAT = "slurmtron-checkpoint"
FORMAT_VERSION = 2  # 2: SHA-256 digests ("hash" names the algorithm); 1: BLAKE2b-256, still loaded
VERSION_HASHES = {1: (BLAKE2B_NAME,), 2: tuple(HASHES)}  # the digests each manifest version may carry


@dataclass
class CommitResult:
    """What :func:`commit` did; the worker logs it in the ``checkpoint_saved`` event."""

    path: Path  # the final directory iter_NNNNNNN
    bytes: int  # payload bytes (all files, manifest excluded)
    seconds: float  # time spent in commit (fsync + hash + renames + prune), by the injected clock
    files: int  # payload files
    pruned: list = field(default_factory=list)  # directories removed by the prune
    quarantined: list = field(default_factory=list)  # [(original path, quarantined path, reason)]
    prune_error: Optional[str] = None  # a storage error that stopped the prune (the commit itself succeeded)


@dataclass
class PruneResult:
    removed: list = field(default_factory=list)  # directories deleted
    quarantined: list = field(default_factory=list)  # [(original path, quarantined path, reason)]


def dir_name(step: int) -> str:
    """The committed checkpoint's directory name (:func:`launch.paths.checkpoint_name`)."""
    return checkpoint_name(step)


def staging_path(root: Path, step: int) -> Path:
    return Path(root) / (dir_name(step) + STAGING_SUFFIX)


def final_path(root: Path, step: int) -> Path:
    return Path(root) / dir_name(step)


def parse_dir_name(name: str) -> Optional[tuple[int, str]]:
    """``iter_0000010`` -> (10, ''), ``iter_0000010.tmp`` -> (10, '.tmp'); None for anything else."""
    return parse_checkpoint_name(name)


def prepare_staging(root: Path, step: int, *, storage: Optional[LocalStorage] = None) -> Path:
    """Rank 0, before any rank writes: an empty staging directory for ``step``.

    A staging directory left by a save that was killed is removed first, so no shard of the
    torn save can end up in the new one; so are torn saves of other steps and ``.del``
    leftovers (one writer per run: no other save is live), which frees their space before the
    free-space check of this save.
    """
    st = storage or LocalStorage()
    path = staging_path(root, step)
    st.makedirs(Path(root))
    restore_set_aside(root, storage=st)
    for name in st.list_dir(Path(root)):  # torn saves of any step, interrupted deletions: garbage, and space
        parsed = parse_dir_name(name)
        if parsed and parsed[1] in (STAGING_SUFFIX, DELETE_SUFFIX) and Path(root) / name != path:
            st.remove_tree(Path(root) / name)
    if st.exists(path):
        st.remove_tree(path)
    st.makedirs(path)
    st.fsync_dir(Path(root))
    return path


def restore_set_aside(root: Path, *, storage: Optional[LocalStorage] = None) -> list[Path]:
    """Rename each ``iter_N.old`` whose ``iter_N`` is missing back to ``iter_N``.

    That state means a re-save of step N was killed between moving the committed checkpoint
    aside and renaming the new one in: the ``.old`` copy is still a complete, committed
    checkpoint (resume would load it as it is), so it gets its name back before the next
    save, and the prune does not treat it as garbage.
    """
    st = storage or LocalStorage()
    root = Path(root)
    restored = []
    for name in st.list_dir(root):
        parsed = parse_dir_name(name)
        if parsed and parsed[1] == ASIDE_SUFFIX and not st.exists(final_path(root, parsed[0])):
            st.rename(root / name, final_path(root, parsed[0]))
            restored.append(final_path(root, parsed[0]))
    if restored:
        st.fsync_dir(root)
    return restored


def seal_files(
    directory: Path,
    rel_files: Sequence[str],
    *,
    storage: Optional[LocalStorage] = None,
    threads: int = 4,
) -> dict[str, tuple[int, str]]:
    """fsync and hash ``rel_files`` under ``directory``: {rel: (size, hex digest of :data:`HASH_NAME`)}.

    Rank 0 calls it (through :func:`commit`) for the files nobody sealed; any rank may call
    it for the shards it wrote, and pass the gathered result to :func:`commit` as ``digests``.
    hashlib releases the GIL, so ``threads`` files are hashed in parallel.
    """
    st = storage or LocalStorage()
    directory = Path(directory)

    def seal(rel: str) -> tuple[str, int, str]:
        p = directory / rel
        st.fsync_file(p)
        n, digest = st.digest(p, hash_name=HASH_NAME)
        return rel, n, digest

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        return {rel: (n, d) for rel, n, d in pool.map(seal, list(rel_files))}


def build_manifest(step: int, meta: dict, files: dict, now: float, run: Optional[dict] = None) -> dict:
    """The manifest document (kept separate so resume and tests share one definition).

    ``run`` is the owner: ``{"name", "id", "model"}`` (see :func:`recovery.resume.owner_problem`).
    """
    doc = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": int(step),
        "time": now,
        "hash": HASH_NAME,
        "meta": meta,
        "files": files,
    }
    if run is not None:
        doc["run"] = run
    return doc


def read_latest(root: Path, *, storage: Optional[LocalStorage] = None) -> Optional[str]:
    """The directory name ``latest`` points at, or None (missing/unreadable). Only a hint."""
    st = storage or LocalStorage()
    try:
        name = st.read_text(Path(root) / LATEST).strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if parse_dir_name(name) and not parse_dir_name(name)[1] else None


def commit(
    root: Path,
    step: int,
    meta: dict,
    *,
    keep: int,
    storage: Optional[LocalStorage] = None,
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
    hash_threads: int = 4,
    digests: Optional[Mapping[str, tuple[int, str]]] = None,
    run: Optional[dict] = None,
) -> CommitResult:
    """Rank 0, after every rank finished writing into :func:`staging_path`: make it durable.

    ``meta`` goes into the manifest verbatim (JSON-serialisable): the worker puts the
    training state summary there (layout, optimizer type, consumed samples, ...), so resume
    can refuse an incompatible checkpoint without opening the shards. ``keep`` >= 1.

    ``digests`` ({relative path: (size, hex digest)}) are files the ranks that wrote them
    already sealed with :func:`seal_files` (fsynced and hashed while still in their page
    cache) and gathered to rank 0: their size is re-checked, but rank 0 does not read them
    again. At scale this is the difference between rank 0 re-reading the whole checkpoint
    at one client's bandwidth on every save and each rank hashing only its own shards.
    """
    if keep < 1:
        raise ValueError(f"keep_checkpoints must be >= 1, got {keep}")
    st = storage or LocalStorage()
    root = Path(root)
    t0 = clock()
    staging = staging_path(root, step)
    final = final_path(root, step)
    if not st.is_dir(staging):
        raise FileNotFoundError(f"no staging directory {staging}: call prepare_staging first")

    rel_files = [f for f in st.list_files(staging) if f != MANIFEST]
    given = dict(digests or {})
    unknown = sorted(set(given) - set(rel_files))
    if unknown:
        raise ValueError(f"digests given for files not in {staging}: {unknown[:3]}")
    for rel, (n, _d) in given.items():
        if st.size(staging / rel) != n:
            raise ValueError(f"{rel} changed after it was sealed: {st.size(staging / rel)} bytes, sealed at {n}")
    sealed_here = seal_files(staging, [f for f in rel_files if f not in given], storage=st, threads=hash_threads)
    sealed_all = {**given, **sealed_here}
    sealed = [(rel, sealed_all[rel][0], sealed_all[rel][1]) for rel in rel_files]
    files = {rel: {"size": n, digest_key(HASH_NAME): d} for rel, n, d in sealed}
    for d in st.list_subdirs(staging):
        st.fsync_dir(d)

    manifest = build_manifest(step, meta, files, wall_clock(), run=run)
    st.write_text(staging / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True, default=str))
    st.fsync_dir(staging)

    aside = Path(str(final) + ASIDE_SUFFIX)
    if st.exists(final):
        if st.exists(aside):
            st.remove_tree(aside)
        st.rename(final, aside)
        st.fsync_dir(root)
    st.rename(staging, final)
    st.fsync_dir(root)
    if st.exists(aside):
        st.remove_tree(aside)

    tmp = root / (LATEST + STAGING_SUFFIX)
    st.write_text(tmp, final.name + "\n")
    st.replace(tmp, root / LATEST)
    st.fsync_dir(root)

    pr, prune_error = PruneResult(), None
    try:
        pr = prune(root, keep=keep, protect=(final.name,), storage=st, clock=wall_clock)
    except OSError as e:  # the checkpoint is committed; an unreadable or unwritable old one only stops the prune
        err = classify(e)
        if err is None:
            raise
        prune_error = str(err)
    return CommitResult(
        path=final,
        bytes=sum(n for _, n, _ in sealed),
        seconds=clock() - t0,
        files=len(sealed),
        pruned=pr.removed,
        quarantined=pr.quarantined,
        prune_error=prune_error,
    )


def abort_save(root: Path, step: int, *, storage: Optional[LocalStorage] = None) -> list[Path]:
    """After a save failed (ENOSPC, EDQUOT, EIO, ...): remove its staging directory, keep every committed one.

    Frees the space the torn save took, and gives a committed checkpoint that a re-save of the
    same step had moved aside (``iter_N.old``) its name back. Returns what was removed.
    """
    st = storage or LocalStorage()
    root = Path(root)
    removed = []
    staging = staging_path(root, step)
    if st.exists(staging):
        st.remove_tree(staging)
        removed.append(staging)
    restore_set_aside(root, storage=st)
    if removed:
        st.fsync_dir(root)
    return removed


def prune(
    root: Path,
    *,
    keep: int,
    protect: tuple = (),
    storage: Optional[LocalStorage] = None,
    clock: Callable[[], float] = time.time,
) -> PruneResult:
    """Keep the newest ``keep`` checkpoints whose manifest and file sizes check out.

    Deleted: final checkpoints older than the ``keep``-th newest verified one (so only ever
    older than the newest verified one), every ``.tmp`` leftover of a killed save, ``.old``
    copies whose step has a verified final checkpoint again (:func:`restore_set_aside` runs
    first) and ``.del`` leftovers of an interrupted deletion. Only rank 0 writes, and only
    inside :func:`commit` or between :func:`prepare_staging` and :func:`commit`, so no live
    save is touched. Never deleted: the target of ``latest``, anything in ``protect``, and a
    checkpoint that fails the check: that one is *quarantined* (moved to ``quarantine/``
    with its reason) so neither a resume nor a later prune can mistake it for garbage. The
    check here is the cheap one (manifest + sizes, ``deep=False``): re-hashing every kept
    checkpoint on every save would cost a full read of K checkpoints.

    A storage error (EACCES, EIO, ESTALE, ...) raises :class:`recovery.storage.StorageError`
    before anything else is deleted: an unreadable checkpoint is not a corrupt one.
    """
    st = storage or LocalStorage()
    root = Path(root)
    restore_set_aside(root, storage=st)
    protected = set(protect)
    latest = read_latest(root, storage=st)
    if latest:
        protected.add(latest)
    finals: list[tuple[int, str]] = []
    leftovers: list[tuple[int, str, str]] = []
    for name in st.list_dir(root):
        parsed = parse_dir_name(name)
        if parsed is None or not st.is_dir(root / name):
            continue
        step, suffix = parsed
        if suffix:
            leftovers.append((step, suffix, name))
        else:
            finals.append((step, name))
    finals.sort(reverse=True)
    result = PruneResult()
    kept: list[int] = []
    verified_steps: set = set()
    doomed: list[str] = []
    for step, name in finals:
        reason = verify(root / name, storage=st, deep=False)
        if reason is None:
            verified_steps.add(step)
        else:
            if name not in protected:
                dest = quarantine(root, root / name, f"failed verification during prune: {reason}",
                                  storage=st, clock=clock)
                result.quarantined.append((root / name, dest, reason))
            continue
        if len(kept) < keep:
            kept.append(step)
        elif name not in protected:
            doomed.append(name)
    for step, suffix, name in leftovers:
        if suffix == ASIDE_SUFFIX and step not in verified_steps:
            continue  # a committed copy whose re-save did not verify: keep it (resume may load it)
        doomed.append(name)
    for name in doomed:
        parsed = parse_dir_name(name)
        if parsed and parsed[1] != DELETE_SUFFIX:
            gone = root / (dir_name(parsed[0]) + DELETE_SUFFIX)
            if st.exists(gone):
                st.remove_tree(gone)
            st.rename(root / name, gone)  # never half-deleted under a name a resume would look at
            st.fsync_dir(root)
        else:
            gone = root / name
        st.remove_tree(gone)
        result.removed.append(root / name)
    if result.removed:
        st.fsync_dir(root)
    return result


def manifest_of(path: Path, *, storage: Optional[LocalStorage] = None) -> dict[str, Any]:
    """Parse ``path/manifest.json`` (raises OSError/ValueError on a missing or bad one)."""
    st = storage or LocalStorage()
    doc = json.loads(st.read_text(Path(path) / MANIFEST))
    if not isinstance(doc, dict):
        raise ValueError("manifest is not a JSON object")
    return doc


def _storage_error(e: OSError, path: Path) -> Optional[StorageError]:
    err = classify(e)
    if err is not None and err.filename in ("?", "None"):
        err = StorageError(err.kind, e.errno or 0, str(path), e.strerror or "")
    return err


def verify(
    path: Path,
    *,
    storage: Optional[LocalStorage] = None,
    deep: bool = True,
    threads: int = 4,
) -> Optional[str]:
    """None if ``path`` is a complete, intact checkpoint; otherwise the reason it is not.

    ``deep=False`` checks the manifest and file sizes only (cheap: used by the prune);
    ``deep=True`` also re-hashes every file (a full read, ``threads`` files at a time; used
    before loading).

    A reason means *corrupt or incomplete*: a checksum, size, listing or manifest failure. A
    file that cannot be read at all (EACCES, EIO, ESTALE, ...) says nothing about the bytes,
    so it raises :class:`recovery.storage.StorageError` instead (which file, which errno).
    """
    st = storage or LocalStorage()
    path = Path(path)
    if not st.is_dir(path):
        return "not a directory"
    parsed = parse_dir_name(path.name)
    if parsed is None:
        return "not a checkpoint directory name (iter_NNNNNNN)"
    if parsed[1] == STAGING_SUFFIX:
        return "staging directory: the save never committed (killed during the save?)"
    if parsed[1] == DELETE_SUFFIX:
        return "being deleted by a prune"
    if not st.exists(path / MANIFEST):
        return "no manifest.json: incomplete or not written by slurmtron's commit"
    try:
        doc = manifest_of(path, storage=st)
    except OSError as e:
        err = _storage_error(e, path / MANIFEST)
        if err is not None:
            raise err from e
        return f"manifest.json unreadable: {e}"
    except (ValueError, UnicodeDecodeError) as e:
        return f"manifest.json unreadable: {e}"
    version = doc.get("version")
    if doc.get("format") != FORMAT or version not in VERSION_HASHES:
        return (f"manifest format {doc.get('format')!r} v{version!r}, expected {FORMAT!r} "
                f"v{' or v'.join(str(v) for v in sorted(VERSION_HASHES))}")
    hash_name = doc.get("hash")
    if hash_name not in VERSION_HASHES[version]:
        return f"manifest v{version} hash {hash_name!r}, expected one of {list(VERSION_HASHES[version])}"
    key = digest_key(hash_name)
    if doc.get("step") != parsed[0]:
        return f"manifest step {doc.get('step')!r} != directory step {parsed[0]}"
    files = doc.get("files")
    if not isinstance(files, dict) or not files:
        return "manifest lists no files"
    try:
        present = set(f for f in st.list_files(path) if f != MANIFEST)
    except OSError as e:
        err = _storage_error(e, path)
        if err is not None:
            raise err from e
        return f"cannot list {path.name}: {e}"
    missing = sorted(set(files) - present)
    if missing:
        return f"missing file {missing[0]}" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else "")
    extra = sorted(present - set(files))
    if extra:
        return f"unlisted file {extra[0]}" + (f" (+{len(extra) - 1} more)" if len(extra) > 1 else "")
    for rel in sorted(files):
        entry = files[rel]
        try:
            size = st.size(path / rel)
        except OSError as e:
            err = _storage_error(e, path / rel)
            if err is not None:
                raise err from e
            return f"cannot stat {rel}: {e}"
        if size != entry.get("size"):
            return f"size mismatch {rel}: {size} bytes on disk, {entry.get('size')} in manifest"
    if deep:
        def check(rel: str) -> Optional[str]:
            try:
                _n, digest = st.digest(path / rel, hash_name=hash_name)
            except OSError as e:
                err = _storage_error(e, path / rel)
                if err is not None:
                    raise err from e
                return f"cannot read {rel}: {e}"
            want = str(files[rel].get(key))
            if digest != want:
                return f"checksum mismatch {rel}: {key} {digest[:16]}... != manifest {want[:16]}..."
            return None

        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            for reason in pool.map(check, sorted(files)):
                if reason:
                    return reason
    return None
