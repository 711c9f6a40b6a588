"""Find the checkpoint to resume from: the newest one that is complete AND verified.

The ``latest`` pointer is only a hint. The truth is the directory listing plus each
candidate's manifest: a checkpoint is loaded only if ``manifest.json`` parses, names this
format and version, agrees with the directory's step, and every listed file is present with
the listed size and BLAKE2b digest (and no unlisted file sneaked in). Anything else, such as
a staging ``.tmp`` left by a kill during a save, a directory without a manifest, or a shard
with one flipped byte, is skipped *with a reason*, and the search falls back to the
previous checkpoint. The worker turns every skip into a ``resume_fallback`` event and a log
line, so a silent fallback cannot happen (Megatron-LM #1570, NVRx PR #376 are what loading
torn or mixed checkpoints looks like).

No torch here: ``python -m recovery.resume RUN_DIR/checkpoints`` verifies on a login node.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from recovery.commit import ASIDE_SUFFIX, manifest_of, parse_dir_name, read_latest, verify
from recovery.storage import LocalStorage

__all__ = ["Resume", "find_latest_verified", "main", "verify"]  # verify lives with the commit it checks


@dataclass
class Resume:
    """The search result. ``path``/``step`` are None when there is nothing to resume from."""

    path: Optional[Path]
    step: Optional[int]
    meta: dict = field(default_factory=dict)
    skipped: list = field(default_factory=list)  # [(path, reason)] newer candidates passed over, newest first
    latest_hint: Optional[str] = None  # what the `latest` file said (may disagree; it is only a hint)


def find_latest_verified(
    root: Path,
    *,
    storage: Optional[LocalStorage] = None,
    deep: bool = True,
) -> Resume:
    """Newest verified checkpoint under ``root``; newer candidates that fail are in ``skipped``.

    Candidates are every ``iter_NNNNNNN[.tmp|.old]`` directory, newest step first (at equal
    step: the final name, then ``.old``, then ``.tmp``). A ``.old`` directory is a committed
    checkpoint that a re-save of the same step had moved aside when it was killed, so it is
    loaded if it verifies; a ``.tmp`` never is. Older checkpoints than the one chosen are not
    read at all, so the cost is one deep verification in the common case.
    """
    st = storage or LocalStorage()
    root = Path(root)
    hint = read_latest(root, storage=st)
    candidates = []
    for name in st.list_dir(root):
        parsed = parse_dir_name(name)
        if parsed is None or not st.is_dir(root / name):
            continue
        step, suffix = parsed
        candidates.append((step, {"": 0, ASIDE_SUFFIX: 1}.get(suffix, 2), name))
    candidates.sort(key=lambda c: (-c[0], c[1]))
    skipped: list = []
    for step, _order, name in candidates:
        path = root / name
        reason = verify(path, storage=st, deep=deep)
        if reason is None:
            meta = manifest_of(path, storage=st).get("meta") or {}
            return Resume(path=path, step=step, meta=meta, skipped=skipped, latest_hint=hint)
        skipped.append((path, reason))
    return Resume(path=None, step=None, meta={}, skipped=skipped, latest_hint=hint)


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m recovery.resume CHECKPOINT_ROOT``: print what a restart would load, and why."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m recovery.resume CHECKPOINT_ROOT", file=sys.stderr)
        return 2
    r = find_latest_verified(Path(args[0]))
    for path, reason in r.skipped:
        print(f"skip {path}: {reason}")
    print(json.dumps({"path": str(r.path) if r.path else None, "step": r.step,
                      "latest_hint": r.latest_hint, "meta": r.meta}, default=str))
    return 0 if r.path else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
