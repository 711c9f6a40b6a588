"""Whose writes a checkpoint may carry: refuse to resume from one that other users can change.

A checkpoint is loaded into the run's processes; anyone who can write its directory or files can
change what is loaded (and reseal the manifest, which is an integrity check, not authentication).
So before a resume, the checkpoint directory that would be loaded, every file in it, and the run's
checkpoint directory above it must be owned by the user the run runs as and writable by nobody else
(no group or world write bit). A symlink among them is judged by what it names, and by every directory above
that, where another user could swap the target (each owned by the user or root, and writable by nobody else
unless sticky, like ``/tmp``). Anything else refuses the start with
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
    if stat.S_ISLNK(st.st_mode):  # a symlink's own bits mean nothing: what it names, and the way there, are judged
        return _link_problem(path, uid)
    return _mode_problem(path, st, uid)


def _mode_problem(path: Path, st: os.stat_result, uid: int) -> Optional[str]:
    if st.st_uid != uid:
        return f"{path} is owned by uid {st.st_uid}, not by this run's user (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "group- and world-writable" if st.st_mode & stat.S_IWOTH and st.st_mode & stat.S_IWGRP else \
            "world-writable" if st.st_mode & stat.S_IWOTH else "group-writable"
        return f"{path} is {who} (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _link_problem(link: Path, uid: int) -> Optional[str]:
    """Why what symlink ``link`` names could be changed by another user: the target itself (owned by this user,
    writable by nobody else), and every directory above it, where another user could swap the target (each owned by
    this user or root, and writable by nobody else unless sticky, like /tmp)."""
    target = Path(os.path.realpath(link))
    if not target.exists():
        return f"{link} is a symlink to {target}, which does not exist"
    why = _mode_problem(target, os.stat(target), uid)
    if why:
        return f"{link} is a symlink to {target}: {why.replace(str(target) + ' ', '', 1)}"
    for d in target.parents:
        st = os.stat(d)
        if st.st_uid not in (uid, 0):
            return f"{link} is a symlink into {d}, owned by uid {st.st_uid}, not by this run's user (uid {uid}) or root"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            return (f"{link} is a symlink into {d}, which other users can write (mode {stat.S_IMODE(st.st_mode):o}): "
                    "they could replace what it names")
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


def tree_writable_by_others(top: Path, path: Path, *, uid: Optional[int] = None) -> Optional[str]:
    """Why another user could have changed directory ``path`` (below ``top``), or None: ``top``, every directory
    from it down to ``path``, and everything under ``path`` (symlinks judged as in :func:`writable_by_others`).
    The node-local tier's rule: the same as the global tier's, for a tree of sets. Raises OSError like it."""
    uid = os.getuid() if uid is None else uid
    top, path = Path(top), Path(path)
    chain = [top]
    for part in path.relative_to(top).parts:
        chain.append(chain[-1] / part)
    for d in chain:
        why = _problem(d, uid)
        if why:
            return why
    for dirpath, dirnames, filenames in os.walk(path):  # never follows a symlinked directory: it is judged instead
        for name in sorted(dirnames + filenames):
            why = _problem(Path(dirpath) / name, uid)
            if why:
                return why
    return None
