"""Checkpoints that must not be loaded, and must not be lost either: ``<checkpoints>/quarantine/``.

A checkpoint that fails its checksum or completeness check, and every checkpoint a run was
explicitly told to start over from (``training.restart_from_scratch=true``), is *moved* (one
rename on the same filesystem) to ``quarantine/<name>.<UTC time>``, with the reason beside it
in ``quarantine/<name>.<UTC time>.reason.json``. Nothing here deletes; the resume search and
the prune never look inside ``quarantine/`` (its name is not a checkpoint name). A person
decides what to do with it: inspect it, move it back, or delete it.

The reason file is written (and fsynced) before the move, so a kill between the two leaves a
reason without a directory, never a quarantined directory without its reason.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Optional

from launch.paths import QUARANTINE as QUARANTINE_DIR
from recovery.storage import LocalStorage

REASON_SUFFIX = ".reason.json"


def quarantine_dir(root: Path) -> Path:
    return Path(root) / QUARANTINE_DIR


def quarantine(
    root: Path,
    path: Path,
    reason: str,
    *,
    storage: Optional[LocalStorage] = None,
    clock: Callable[[], float] = time.time,
) -> Path:
    """Move ``path`` (a checkpoint directory under ``root``) into the quarantine; returns its new path."""
    st = storage or LocalStorage()
    root, path = Path(root), Path(path)
    qdir = quarantine_dir(root)
    st.makedirs(qdir)
    now = clock()
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    dest = qdir / f"{path.name}.{stamp}"
    n = 1
    while st.exists(dest) or st.exists(Path(str(dest) + REASON_SUFFIX)):
        n += 1
        dest = qdir / f"{path.name}.{stamp}.{n}"
    doc = {"original": path.name, "reason": reason, "time": now}
    st.write_text(Path(str(dest) + REASON_SUFFIX), json.dumps(doc, indent=1, sort_keys=True) + "\n")
    st.rename(path, dest)
    st.fsync_dir(root)
    st.fsync_dir(qdir)
    return dest


def list_quarantine(root: Path, *, storage: Optional[LocalStorage] = None) -> list[tuple[str, str]]:
    """[(quarantined name, reason)] of ``root``'s quarantine (checkpoint directories, and files found where a
    checkpoint directory belonged), oldest name first."""
    st = storage or LocalStorage()
    qdir = quarantine_dir(root)
    out = []
    for name in st.list_dir(qdir):
        if name.endswith(REASON_SUFFIX):
            continue
        try:
            reason = json.loads(st.read_text(qdir / (name + REASON_SUFFIX))).get("reason", "?")
        except (OSError, ValueError, AttributeError):
            reason = "(no reason file)"
        out.append((name, str(reason)))
    return out
