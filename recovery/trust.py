"""Whose writes a checkpoint may carry: refuse to resume from one that other users can change.

A checkpoint is loaded into the run's processes; anyone who can write its directory or files can
change what is loaded (and reseal the manifest, which is an integrity check, not authentication).
So before a resume, the checkpoint directory that would be loaded, every file in it, and the run's
checkpoint directory above it must be owned by the user the run runs as and writable by nobody else
(no group or world write bit). Anything else refuses the start with
:data:`recovery.policy.EXIT_SHARED_CKPT`, naming the path and the fix.

A site whose project directories are shared on purpose (a group-writable checkpoint root, umask 002)
says so with the environment switch ``SLURMTRON_TRUST_SHARED_CHECKPOINTS=1`` on the job (or the
inspector): an environment switch rather than a config field because it is a decision about the
machine's users, made by whoever runs the job there, not a property of the run that every copy of
its ``config.yaml`` should carry. Trusting is still said: a WARNING and an event per attempt.

Standard library only.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Mapping, Optional

TRUST_ENV = "SLURMTRON_TRUST_SHARED_CHECKPOINTS"


def trusts_shared(env: Mapping[str, str]) -> bool:
    """Did the user say checkpoints writable by others are to be loaded anyway?"""
    return str(env.get(TRUST_ENV, "")).strip().lower() in ("1", "true", "yes")


def _problem(path: Path, uid: int) -> Optional[str]:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return None  # a symlink's own bits mean nothing; what it names is judged where it is listed
    if st.st_uid != uid:
        return f"{path} is owned by uid {st.st_uid}, not by this run's user (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "group- and world-writable" if st.st_mode & stat.S_IWOTH and st.st_mode & stat.S_IWGRP else \
            "world-writable" if st.st_mode & stat.S_IWOTH else "group-writable"
        return f"{path} is {who} (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def writable_by_others(root: Path, ckpt: Path, *, uid: Optional[int] = None) -> Optional[str]:
    """Why checkpoint ``ckpt`` (under the run's checkpoint directory ``root``) could have been changed by
    another user, or None. Raises OSError when a path cannot be examined."""
    uid = os.getuid() if uid is None else uid
    root, ckpt = Path(root), Path(ckpt)
    for path in [root, ckpt] + [ckpt / name for name in sorted(os.listdir(ckpt))]:
        why = _problem(path, uid)
        if why:
            return why
    return None
