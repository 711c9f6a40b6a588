"""Find and parse a run's inputs: log files, ``sacct`` dumps, the event log, ``config.yaml``.

``report.py`` accepts run directories (``runs/<name>/`` with ``config.yaml``,
``logs/*.out``, ``events.jsonl``, optionally ``sacct.txt``), single log files and sacct
dumps; this module turns any mix of them into DataFrames plus skipped-line counts.
A file is a sacct dump if its first non-blank line is a ``|`` header with a ``JobID`` field; ``*.jsonl`` is an
event log; anything else is a log.
"""
from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pandas as pd

from analysis.parse_events import parse_events_file
from analysis.parse_megatron import (
    DEFAULT_CHUNK_BYTES, iter_text_chunks, parse_checkpoint_text, parse_iteration_text, source_ids,
)
from analysis.parse_slurm import parse_sacct_file
from analysis.parse_validation import parse_validation_file
from analysis.signatures import parse_signature_text
from launch.paths import RunPaths

__all__ = ["RunInputs", "load_paths", "parse_log_file", "read_config"]


@dataclass
class RunInputs:
    """Everything parsed for one run (or one set of loose files)."""

    name: str
    iterations: pd.DataFrame
    signatures: pd.DataFrame
    checkpoints: pd.DataFrame
    events: pd.DataFrame | None = None
    sacct: pd.DataFrame | None = None
    config: dict[str, Any] | None = None
    skipped: dict[str, int] = field(default_factory=dict)
    validation: pd.DataFrame | None = None  # Megatron's "validation loss at iteration N" lines
    memory_plan: dict[str, Any] | None = None  # the planner's memory estimate written at submit (memory_plan.json)


def parse_log_file(path: str | os.PathLike, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
    """Iterations (with file offsets), error signatures and checkpoint lines of one log."""
    job_id, rank = source_ids(path)
    its, sigs, cks, skipped = [], [], [], 0
    seq0 = 0
    for off, text in iter_text_chunks(path, chunk_bytes):
        it, sk = parse_iteration_text(text, source=str(path), job_id=job_id, rank=rank, offsets=True, base_offset=off)
        it["seq"] += seq0
        seq0 += len(it)
        its.append(it)
        skipped += sk
        sigs.append(parse_signature_text(text, source=str(path), job_id=job_id, base_offset=off)[0])
        cks.append(parse_checkpoint_text(text, source=str(path), job_id=job_id, rank=rank, base_offset=off)[0])
    if not its:
        it, _ = parse_iteration_text("", source=str(path), job_id=job_id, rank=rank, offsets=True)
        its, sigs, cks = [it], [parse_signature_text("")[0]], [parse_checkpoint_text("")[0]]
    return (_concat(its), _concat(sigs), _concat(cks), skipped)


def _concat(frames: list[pd.DataFrame]) -> pd.DataFrame:
    frames = [f for f in frames if not f.empty] or frames[:1]
    return pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0].reset_index(drop=True)


def read_config(path: str | os.PathLike) -> dict[str, Any] | None:
    """The run's composed ``config.yaml`` as a plain dict (omegaconf; no ``launch`` import)."""
    p = Path(path)
    if not p.is_file():
        return None
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_container(OmegaConf.load(p), resolve=False)  # type: ignore[return-value]
    except Exception:  # a broken config must not stop the report; MFU just goes missing
        return None


def _is_sacct(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(4096).decode("utf-8", errors="replace")
    except OSError:
        return False
    first = next((ln for ln in head.splitlines() if ln.strip()), "")
    return "|" in first and bool({"JobID", "JobIDRaw"} & set(first.strip().split("|")))


def _sacct_header(path: Path) -> list[str]:
    try:
        with open(path, "rb") as f:
            head = f.read(4096).decode("utf-8", errors="replace")
    except OSError:
        return []
    first = next((ln for ln in head.splitlines() if ln.strip()), "")
    return [c for c in first.strip().split("|") if c]


def _classify(files: list[Path]) -> tuple[list[Path], list[Path], list[Path]]:
    logs, saccts, events = [], [], []
    for f in files:
        if f.suffix == ".jsonl":
            events.append(f)
        elif _is_sacct(f):
            saccts.append(f)
        else:
            logs.append(f)
    return logs, saccts, events


def _parse(name: str, files: list[Path], config: dict | None, chunk_bytes: int) -> RunInputs:
    logs, saccts, evs = _classify(files)
    its, sigs, cks, skipped = [], [], [], {"iteration_lines": 0, "sacct_lines": 0, "event_lines": 0}
    vals = []
    for f in sorted(logs):
        it, sg, ck, sk = parse_log_file(f, chunk_bytes)
        its.append(it), sigs.append(sg), cks.append(ck)
        skipped["iteration_lines"] += sk
        # a validation block is rare: only files that hold one are parsed for it (a cheap byte search first)
        if _holds(f, b"validation loss at"):
            vals.append(parse_validation_file(f))
    if not its:
        it, sg, ck, _ = parse_log_file(os.devnull)
        its, sigs, cks = [it], [sg], [ck]
    sacct = None
    if saccts:
        parts = []
        for f in saccts:
            df, sk = parse_sacct_file(f)
            skipped["sacct_lines"] += sk
            header = set(_sacct_header(f))
            skipped["sacct_columns"] = skipped.get("sacct_columns", 0) + len(
                [c for c in header if c.lower() not in SACCT_FIELDS_USED])
            if not df.empty:
                parts.append(df)
        sacct = pd.concat(parts, ignore_index=True) if parts else None
    events = None
    if evs:
        parts = []
        for f in evs:
            df, sk = parse_events_file(f)
            skipped["event_lines"] += sk
            parts.append(df)
        events = pd.concat(parts, ignore_index=True)
    validation = pd.concat(vals, ignore_index=True) if vals else None
    return RunInputs(name, _concat(its), _concat(sigs), _concat(cks), events, sacct, config, skipped, validation)


def _holds(path: Path, needle: bytes, block: int = 1 << 24) -> bool:
    with open(path, "rb") as fh:
        tail = b""
        while True:
            data = fh.read(block)
            if not data:
                return False
            if needle in tail + data:
                return True
            tail = data[-len(needle):]


# sacct fields the report reads (lower case); any other column of a dump is counted as skipped
SACCT_FIELDS_USED = frozenset({"jobid", "jobidraw", "state", "submit", "start", "end", "eligible", "elapsed",
                               "nnodes", "alloctres"})


def not_regular(p: Path) -> Optional[str]:
    """Why ``p`` (which exists) cannot be read as an input file, or None for a regular file or directory."""
    try:
        mode = p.stat().st_mode
    except OSError as e:
        return f"cannot stat: {e.strerror or e}"
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode)
            else "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a file")
    return f"{kind}, not a regular file (reading it could block or never end)"


def load_paths(paths: list[str | os.PathLike], chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               ignored: Optional[list] = None) -> list[RunInputs]:
    """One :class:`RunInputs` per run directory, plus one for all loose files together.

    A directory with ``config.yaml`` or ``logs/`` is a run; a directory without them (a
    sweep root) contributes each subdirectory that is a run. An argument that is a FIFO, a
    device or a socket is not read: it is appended to ``ignored`` as ``(path, reason)``.
    """
    runs: list[RunInputs] = []
    loose: list[Path] = []
    for p in map(Path, paths):
        why = not_regular(p) if p.exists() else None
        if why:
            if ignored is not None:
                ignored.append((str(p), why))
            continue
        if p.is_dir():
            if _is_run_dir(p):
                runs.append(_parse_run_dir(p, chunk_bytes))
            else:
                for sub in sorted(q for q in p.iterdir() if q.is_dir()):
                    if _is_run_dir(sub):
                        runs.append(_parse_run_dir(sub, chunk_bytes))
        elif p.is_file():
            loose.append(p)
        else:
            raise FileNotFoundError(f"no such file or directory: {p}")
    if loose:
        runs.append(_parse("files", loose, None, chunk_bytes))
    return runs


def _is_run_dir(d: Path) -> bool:
    paths = RunPaths.of(d)
    return paths.config.exists() or paths.logs.is_dir()


def _parse_run_dir(d: Path, chunk_bytes: int) -> RunInputs:
    paths = RunPaths.of(d)
    files = sorted(f for f in paths.logs.glob("*") if f.is_file()) if paths.logs.is_dir() else []
    if paths.events.is_file():
        files.append(paths.events)
    # sacct dumps: any top-level text file whose first line is a sacct header (sacct.txt, sacct_D.txt ...)
    files += [f for f in sorted(d.iterdir()) if f.is_file() and f.suffix in (".txt", ".psv", "") and _is_sacct(f)]
    run = _parse(d.name, files, read_config(paths.config), chunk_bytes)
    run.memory_plan = read_memory_plan(paths.memory_plan)
    return run


def read_memory_plan(path: Path) -> dict[str, Any] | None:
    """``memory_plan.json`` (JSON, never a pickle) when it holds an estimate, else None."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("total_gib"), (int, float)) else None
