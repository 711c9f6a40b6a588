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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from recovery.commit import (
    ASIDE_SUFFIX,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    STAGING_SUFFIX,
    manifest_of,
    parse_dir_name,
    read_latest,
)
from recovery.storage import HASH_NAME, LocalStorage


@dataclass
class Resume:
    """The search result. ``path``/``step`` are None when there is nothing to resume from."""

    path: Optional[Path]
    step: Optional[int]
    meta: dict = field(default_factory=dict)
    skipped: list = field(default_factory=list)  # [(path, reason)] newer candidates passed over, newest first
    latest_hint: Optional[str] = None  # what the `latest` file said (may disagree; it is only a hint)


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
    if not st.exists(path / MANIFEST):
        return "no manifest.json: incomplete or not written by slurmtron's commit"
    try:
        doc = manifest_of(path, storage=st)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        return f"manifest.json unreadable: {e}"
    if doc.get("format") != FORMAT or doc.get("version") != FORMAT_VERSION:
        return f"manifest format {doc.get('format')!r} v{doc.get('version')!r}, expected {FORMAT!r} v{FORMAT_VERSION}"
    if doc.get("hash") != HASH_NAME:
        return f"manifest hash {doc.get('hash')!r}, expected {HASH_NAME!r}"
    if doc.get("step") != parsed[0]:
        return f"manifest step {doc.get('step')!r} != directory step {parsed[0]}"
    files = doc.get("files")
    if not isinstance(files, dict) or not files:
        return "manifest lists no files"
    present = set(f for f in st.list_files(path) if f != MANIFEST)
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
            return f"cannot stat {rel}: {e}"
        if size != entry.get("size"):
            return f"size mismatch {rel}: {size} bytes on disk, {entry.get('size')} in manifest"
    if deep:
        def check(rel: str) -> Optional[str]:
            try:
                _n, digest = st.digest(path / rel)
            except OSError as e:
                return f"cannot read {rel}: {e}"
            want = str(files[rel].get("blake2b"))
            if digest != want:
                return f"checksum mismatch {rel}: blake2b {digest[:16]}... != manifest {want[:16]}..."
            return None

        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            for reason in pool.map(check, sorted(files)):
                if reason:
                    return reason
    return None


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
