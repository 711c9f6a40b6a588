"""The filesystem operations the checkpoint commit protocol is built from, behind one seam.

:mod:`recovery.commit` and :mod:`recovery.resume` never call ``os`` directly: they take a
:class:`LocalStorage`-shaped object. :class:`LocalStorage` is the real one (POSIX, including Lustre and NFS);
tests subclass it to stop the protocol after any single operation (a simulated crash, see
``tests/test_recovery_commit.py``) and check that what is left on disk is never loaded as a
good checkpoint. Keeping each method one durable step (one rename, one fsync) is what makes
"crash between any two steps" a finite, enumerable set of cases.

The small JSON files of a run (``progress.json``, ``failed_nodes.json``, ``stop.json``, the preflight's files, the
hang summaries) are written by the one :func:`atomic_write_json`: temp file, fsync, rename, fsync of the directory.

Pure Python: no torch, so the login node can verify checkpoints too.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Optional

HASH_NAME = "sha256"  # what new manifests use (recovery.commit.FORMAT_VERSION 2); see new_hasher
BLAKE2B_NAME = "blake2b-256"  # what version-1 manifests used: still verified
_CHUNK = 8 << 20  # 8 MiB reads: large enough to reach sequential bandwidth, small enough for memory

# What an OSError means for a checkpoint. Only a checksum or completeness failure (decided by
# recovery.resume.verify from what *could* be read) marks a checkpoint corrupt; an error that
# stops us from reading or writing at all says nothing about the bytes on disk.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# ENOENT / ENOTDIR inside a checkpoint are a completeness question (a missing file), answered by verify.
_ABSENT_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR})
_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\]")  # dist_checkpointing gathers a writer's OSError as text only


class StorageError(OSError):
    """The filesystem refused an operation for a reason that is not the checkpoint's fault.

    ``kind`` is ``disk_full`` (ENOSPC, EDQUOT) or ``environment`` (EACCES, EPERM, EIO, ESTALE,
    ENOTCONN, a missing mount, ...). Neither may be answered by skipping, deleting or
    quarantining a checkpoint: the run stops and says which file and which errno.
    """

    def __init__(self, kind: str, err: int, filename: str, detail: str = "") -> None:
        self.kind = kind
        self.filename = filename
        name = errno.errorcode.get(err, str(err))
        msg = f"{name} ({os.strerror(err) if err else 'error'}) on {filename}" + (f": {detail}" if detail else "")
        super().__init__(err, msg)
        self.errno_name = name

    def __str__(self) -> str:
        return self.args[1]


def classify(exc: BaseException) -> Optional[StorageError]:
    """The :class:`StorageError` an exception is (or wraps), or None for anything else.

    Walks ``__cause__``/``__context__`` and the per-rank ``failures`` of a torch
    ``CheckpointException``, so an ENOSPC raised deep inside a distributed save is found.
    ENOENT/ENOTDIR are not storage errors (a missing file is for verification to judge).
    """
    seen: set = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, StorageError):
            return e
        if isinstance(e, OSError) and e.errno and e.errno not in _ABSENT_ERRNOS:
            kind = "disk_full" if e.errno in DISK_FULL_ERRNOS else "environment"
            return StorageError(kind, e.errno, str(e.filename or "?"), e.strerror or "")
        m = _ERRNO_TEXT.search(str(e)) if not isinstance(e, OSError) else None
        if m and int(m.group(1)) not in _ABSENT_ERRNOS:  # an OSError that crossed a process as text
            err = int(m.group(1))
            return StorageError("disk_full" if err in DISK_FULL_ERRNOS else "environment", err, "?",
                                str(e).strip().splitlines()[0][:200])
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for v in failures.values():
                stack.append(v[0] if isinstance(v, tuple) else v)
        stack.extend([getattr(e, "__cause__", None), getattr(e, "__context__", None)])
    return None


def _raise_walk_error(err: OSError) -> None:
    raise err


# manifest "hash" name -> (hashlib constructor, the per-file key that holds the hex digest)
HASHES = {
    HASH_NAME: (hashlib.sha256, "sha256"),
    BLAKE2B_NAME: (lambda: hashlib.blake2b(digest_size=32), "blake2b"),
}


def new_hasher(name: str = HASH_NAME):
    """A hasher for the manifest hash ``name`` (default: what new checkpoints use, SHA-256).

    Why SHA-256: it is in the standard library (the login node and CI need nothing extra), it is
    a cryptographic hash, so a flipped bit, a swapped block or a truncated-then-padded shard is
    detected with probability 1 - 2^-256 (a CRC32 over a fleet writing terabytes a day will
    eventually collide), and OpenSSL runs it on the CPU's SHA instructions (x86 since AMD Zen and
    Intel Ice Lake, ARMv8 crypto): 1.79 GB per CPU-second on the CPU machine, 1.9x BLAKE2b's 0.93
    (benchmarks/RESULTS.md), which every save pays once per byte (and every resume once more). Version-1 manifests say
    ``blake2b-256`` and are verified with it. hashlib releases the GIL while hashing, so
    :func:`recovery.commit.commit` hashes files on several threads in parallel.
    """
    try:
        make, _key = HASHES[name]
    except KeyError:
        raise ValueError(f"unknown checkpoint hash {name!r}; known: {sorted(HASHES)}") from None
    return make()


def digest_key(name: str = HASH_NAME) -> str:
    """The manifest's per-file key holding a ``name`` digest (``sha256``, or ``blake2b`` in version 1)."""
    return HASHES[name][1]


class LocalStorage:
    """Real filesystem operations; every mutating method is one durable step of the protocol.

    Another backend (an object store, a test double that crashes) implements the same
    methods; the protocol code only ever calls these.
    """

    # ---- reads -------------------------------------------------------------------------
    def exists(self, path: Path) -> bool:
        return os.path.lexists(path)

    def is_dir(self, path: Path) -> bool:
        return os.path.isdir(path)

    def list_dir(self, path: Path) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []

    def list_files(self, root: Path) -> list[str]:
        """Every regular file under ``root``, as sorted POSIX paths relative to it."""
        out = []
        for dirpath, _dirs, files in os.walk(root, onerror=_raise_walk_error):
            for name in files:
                full = Path(dirpath) / name
                out.append(full.relative_to(root).as_posix())
        return sorted(out)

    def list_subdirs(self, root: Path) -> list[Path]:
        """``root`` and every directory below it (their entries need an fsync too)."""
        return [Path(dirpath) for dirpath, _dirs, _files in os.walk(root, onerror=_raise_walk_error)]

    def size(self, path: Path) -> int:
        return os.stat(path).st_size

    def free_bytes(self, path: Path) -> int:
        """Bytes available to this (unprivileged) user on the filesystem holding ``path``."""
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize

    def identity(self, path: Path) -> tuple:
        """What changes whenever a file's content may have: (device, inode, size, mtime ns, ctime ns). A write,
        a truncate, a rename over it or a touch changes the ctime, which no user can set back."""
        s = os.stat(path)
        return (s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns)

    def read_bytes(self, path: Path) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def read_text(self, path: Path) -> str:
        with open(path, "r", encoding="utf-8") as f:
            return f.read()

    def digest(self, path: Path, hash_name: str = HASH_NAME) -> tuple[int, str]:
        """(bytes read, hex digest) of one file, read in large chunks into one reused buffer."""
        h = new_hasher(hash_name)
        n = 0
        buf = memoryview(bytearray(_CHUNK))
        with open(path, "rb", buffering=0) as f:
            while True:
                got = f.readinto(buf)
                if not got:
                    break
                h.update(buf[:got])
                n += got
        return n, h.hexdigest()

    # ---- durable steps -----------------------------------------------------------------
    def makedirs(self, path: Path) -> None:
        os.makedirs(path, exist_ok=True)

    def remove_tree(self, path: Path) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.unlink(path)

    def write_text(self, path: Path, text: str) -> None:
        """Write and fsync one file (it is not visible under its final name until a rename)."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    def write_bytes(self, path: Path, data: Any) -> None:
        """Write and fsync one file of bytes (or a buffer: a uint8 array is written without a copy)."""
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def fsync_file(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def fsync_dir(self, path: Path) -> None:
        """Make a directory's entries (creations, renames) durable."""
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def rename(self, src: Path, dst: Path) -> None:
        """Atomic on POSIX within one filesystem; a directory ``dst`` must not exist."""
        os.rename(src, dst)

    def replace(self, src: Path, dst: Path) -> None:
        """Atomically replace a *file* ``dst`` (write-temp-then-rename)."""
        os.replace(src, dst)

    # ---- composed ----------------------------------------------------------------------
    def atomic_write_json(self, path: Path, doc: Any) -> None:
        """Write ``doc`` as JSON to ``path`` so that a kill leaves the old file or the new one, never half of one,
        and the new one survives a power loss once this returns: a temp file beside it (unique per writer),
        written and fsynced, renamed over ``path``, then the directory fsynced. The temp file is removed on error."""
        path = Path(path)
        self.makedirs(path.parent)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            self.write_text(tmp, json.dumps(doc, indent=1, default=str))
            self.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        self.fsync_dir(path.parent)


def atomic_write_json(path: Path, doc: Any, storage: Optional[LocalStorage] = None) -> None:
    """:meth:`LocalStorage.atomic_write_json` on ``storage`` (the real filesystem by default)."""
    (storage or LocalStorage()).atomic_write_json(path, doc)


def read_json_dict(path: Path, storage: Optional[LocalStorage] = None) -> Optional[dict]:
    """A small JSON object another process of this run wrote, or None when it is missing, unreadable or not an object
    (the callers treat all three alike)."""
    try:
        doc = json.loads((storage or LocalStorage()).read_text(path))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def size_text(n: float) -> str:
    """Bytes as the checks and notices print them: ``1.64 GB``, ``547 MB``."""
    return f"{n / 1e9:.3g} GB" if n >= 1e9 else f"{n / 1e6:.3g} MB"
