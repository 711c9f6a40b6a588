"""Parse Megatron training logs: iteration lines and checkpoint save/load lines.

Two iteration-line formats are read by one pattern:

* current Megatron-Core (``training_log`` in ``megatron/training/training.py``)::

    [2026-11-29 10:00:00.123456] iteration        5/      20 | consumed samples: 40 |
    elapsed time per iteration (ms): 812.3 | throughput per GPU (TFLOP/s/GPU): 0.1 |
    [MFU: 41.23% |] learning rate: 3.000000E-04 | global batch size: 8 | lm loss: 5.5E+00 |
    loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations: 0 |
    number of nan iterations: 0 |

* the 2021 form (no timestamp, no throughput, lr as ``{:.3E}``, ``lm-loss`` in
  Megatron-DeepSpeed, sometimes no ``consumed samples``).

Why regex over the whole chunk and not a loop over lines: a multi-week run writes
gigabytes; ``re.findall`` over a decoded chunk runs the matching loop in C and hands back
one tuple per iteration line, with no Python work per non-matching line. The numeric
conversion is column-wise pandas. With pyarrow installed, a chunk's lines are split,
filtered and read in Arrow's compute kernels instead (no Python object per line; see
:func:`_arrow_columns`), and the ``re`` path stays the reference and the fallback for
chunks Arrow cannot read the same way. Files are read as bytes in chunks cut at newlines and
decoded with ``errors="replace"``, so binary junk or a torn multibyte character never
raises. Each parser returns ``(frame, skipped)``: ``skipped`` counts lines that looked
like the thing parsed (``iteration N/``) but could not be read (truncated, garbled).
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.signatures import candidate_lines

try:  # optional: the RE2 compute kernels are the fast path; without pyarrow the re path runs
    import pyarrow as pa
    import pyarrow.compute as pc
    _SYSTEM_POOL = pa.system_memory_pool()
except ImportError:  # pragma: no cover
    pa = pc = None

__all__ = [
    "ITERATION_COLUMNS",
    "CHECKPOINT_COLUMNS",
    "iter_text_chunks",
    "line_ranges",
    "read_text",
    "source_ids",
    "parse_iteration_text",
    "parse_iteration_lines",
    "parse_iterations_file",
    "parse_checkpoint_text",
]

DEFAULT_CHUNK_BYTES = 32 << 20

_V = r"[ \t]*([^ \t|\n]*)[ \t]*\|"  # a field's value and the bar after it
_SKIP = r"(?:[^|\n[]*\|)*?"  # lazily step over fields we do not read (never over a "[timestamp]")


def _field(key: str, value: str = _V) -> str:
    # The skip sits inside the optional group: a missing field leaves the position unchanged,
    # a present one is found even behind fields we do not know (``num zeros``, ``mtp loss``).
    return rf"(?:{_SKIP}[ \t]*{key}{value})?"


_HEAD = r"iteration[ \t]+([0-9]+)[ \t]*/[ \t]*([0-9]+)[ \t]*\|"
_MFU_V = r"[ \t]*([^ \t|%\n]*)%[ \t]*\|"
_FIELDS = [  # (key, value pattern) in the order Megatron prints them
    ("consumed samples:", _V),
    (r"elapsed time per iteration \(ms\):", _V),
    (r"throughput per GPU \(TFLOP/s/GPU\):", _V),
    ("MFU:", _MFU_V),
    ("learning rate:", _V),
    ("global batch size:", _V),
    ("lm[ -]loss:", _V),
    ("loss scale:", _V),
    ("grad norm:", _V),
    ("number of skipped iterations:", _V),
    ("number of nan iterations:", _V),
]
_ITERATION_BODY = _HEAD + "".join(_field(k, v) for k, v in _FIELDS)


_TS = r"\[([0-9]{4}-[0-9]{2}-[0-9]{2}[ T][0-9:]{8}(?:[.,][0-9]+)?)\]"
# Fast path: the pattern starts with a literal, so the C matcher skips ahead to each
# "iteration" instead of trying every position; timestamps come from a second pass whose
# matches are a subset of the body's (same prefix), so equal counts mean aligned rows.
_BODY_RE = re.compile(_ITERATION_BODY)
_TS_RE = re.compile(_TS + r"[ \t]*iteration[ \t]+[0-9]+[ \t]*/[ \t]*[0-9]+[ \t]*\|")
# Slow path, one match per line with its own timestamp, for files mixing both formats.
_ITERATION_RE = re.compile(
    r"(?m)^(?:[0-9]+:[ \t]?)?"  # srun --label rank prefix
    r"(?:" + _TS + r")?[ \t]*" + _ITERATION_BODY + r"[^\n]*$"
)
# Lines that claim to be iteration lines; the difference to parsed rows is ``skipped``.
_ITERATION_CANDIDATE_RE = re.compile(r"iteration[ \t]+[0-9]+[ \t]*/")

_RAW_COLUMNS = [
    "timestamp", "iteration", "train_iters", "consumed_samples", "elapsed_ms",
    "tflops_per_gpu", "mfu_pct", "lr", "global_batch_size", "lm_loss", "loss_scale",
    "grad_norm", "skipped_iters", "nan_iters",
]
ITERATION_COLUMNS = ["source", "job_id", "rank", "seq", "offset"] + _RAW_COLUMNS + ["nonfinite"]
_INT_LIMIT = 2**53  # larger iteration numbers are garbage, not progress

_CHECKPOINT_RE = re.compile(
    r"(?:"
    r"(?P<save>saving checkpoint at iteration[ \t]+(?P<save_it>[0-9]+) to (?P<save_path>[^ \t\n]+))"
    r"|(?P<saved>successfully saved checkpoint (?:at|from) iteration[ \t]+(?P<saved_it>[0-9]+)"
    r"(?: to (?P<saved_path>[^ \t\n]+))?)"
    r"|(?P<load>loading (?:distributed |local |global )?checkpoint from (?P<load_path>[^ \t\n]+)"
    r" at iteration[ \t]+(?P<load_it>[0-9]+))"
    r"|(?P<loaded>successfully loaded checkpoint from (?P<loaded_path>[^ \t\n]+)"
    r"[^\n]*? at iteration[ \t]+(?P<loaded_it>[0-9]+))"
    r")"
)
CHECKPOINT_COLUMNS = ["source", "job_id", "rank", "offset", "kind", "iteration", "path"]


def iter_text_chunks(path: str | os.PathLike, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                     start: int = 0, end: int | None = None) -> Iterator[tuple[int, str]]:
    """Yield ``(byte offset, text)`` chunks of a file, each ending at a newline.

    Bounded memory for multi-GB logs: a chunk is cut after its last ``\\n`` and the rest is
    carried over. A "line" longer than a chunk (binary junk) is cut where it is. Decoding
    uses ``errors="replace"``: a newline byte never sits inside a UTF-8 sequence, so cutting
    at newlines never splits a character. ``start``/``end`` limit it to a byte range (which
    should begin and end at line starts: see :func:`line_ranges`).
    """
    offset = start
    carry = b""
    with open(path, "rb") as f:
        f.seek(start)
        while True:
            want = chunk_bytes if end is None else min(chunk_bytes, end - f.tell())
            block = f.read(want) if want > 0 else b""
            if not block:
                break
            data = carry + block
            cut = data.rfind(b"\n")
            if cut < 0 and len(data) < chunk_bytes * 2:
                carry = data
                continue
            cut = len(data) - 1 if cut < 0 else cut
            yield offset, data[: cut + 1].decode("utf-8", errors="replace")
            offset += cut + 1
            carry = data[cut + 1 :]
    if carry:
        yield offset, carry.decode("utf-8", errors="replace")


def line_ranges(path: str | os.PathLike, parts: int) -> list[tuple[int, int]]:
    """Split a file into ``parts`` byte ranges that each start at a line start."""
    size = os.path.getsize(path)
    cuts = [0]
    with open(path, "rb") as f:
        for i in range(1, parts):
            f.seek(max(size * i // parts, cuts[-1]))
            f.readline()
            cuts.append(min(f.tell(), size))
    cuts.append(size)
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def read_text(path: str | os.PathLike) -> str:
    """The whole file as text (bytes decoded with ``errors="replace"``); for small files."""
    return Path(path).read_bytes().decode("utf-8", errors="replace")


_JOB_RANK_RES = [
    re.compile(r"^(?P<job>[0-9]+(?:_[0-9]+)?)_batch\.(?:out|err|log)$"),  # %j_batch.out (the batch shell)
    re.compile(r"^(?P<job>[0-9]+(?:_[0-9]+)?)_(?P<rank>[0-9]+)\.(?:out|err|log)$"),  # %j_%t.out
    re.compile(r"^local_(?P<job>[0-9]+)_rank(?P<rank>[0-9]+)\.(?:out|err|log)$"),  # local_<attempt>_rank<r>
    re.compile(r"[-_.](?P<job>[0-9]{4,})\.(?:out|err|log)$"),  # name-1809562.out
]


def source_ids(path: str | os.PathLike) -> tuple[str | None, int | None]:
    """(job id, rank) from a log file name: ``%j_%t.out``, ``%j_batch.out`` (rank None),
    ``local_<attempt>_rank<r>.out`` (job id ``local-<attempt>``) or ``<name>-<jobid>.out``;
    ``(None, None)`` if none fits."""
    name = Path(path).name
    for i, rx in enumerate(_JOB_RANK_RES):
        m = rx.search(name)
        if m:
            job = m.group("job")
            if i == 2:
                job = f"local-{job}"
            rank = m.groupdict().get("rank")
            return job, int(rank) if rank is not None else None
    return None, None


def _to_float(values) -> np.ndarray:
    """Strings to float64: numpy's C conversion, pandas' coercing one if any value is bad."""
    try:
        return np.array(values, dtype="float64")
    except (ValueError, OverflowError):
        s = pd.Series(values, dtype=object).replace("", None)
        return pd.to_numeric(s, errors="coerce").to_numpy(dtype="float64", na_value=np.nan)


def _to_time(values) -> pd.Series:
    s = pd.Series(values, dtype=object)
    if len(s) == 0 or not s.iloc[0] and not s.astype(bool).any():
        return pd.Series(pd.NaT, index=s.index, dtype="datetime64[us]")
    s = s.replace("", None).str.replace(",", ".", regex=False)
    return pd.to_datetime(s, format="ISO8601", errors="coerce")


def _name_groups(pattern: str, names: list[str]) -> str:
    """``pattern`` with its capturing groups named ``names`` in order (RE2's extract needs names)."""
    out, names, i, class_at = [], list(names), 0, -1  # class_at: where the open [...] starts
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i : i + 2])
            i += 2
            continue
        if class_at >= 0:
            first = i == class_at + 1 or (i == class_at + 2 and pattern[class_at + 1] == "^")
            if c == "]" and not first:
                class_at = -1
        elif c == "[":
            class_at = i
        elif c == "(" and not pattern.startswith("(?", i):
            out.append(f"(?P<{names.pop(0)}>")
            i += 1
            continue
        out.append(c)
        i += 1
    assert not names, names
    return "".join(out)


# The fields of one line with one iteration head, stamp included: the stamp is found iff
# _TS_RE finds it (same prefix, and a line's only head is the one both patterns end at).
_LINE_RE = re.compile(r"(?:" + _TS + r"[ \t]*)?" + _ITERATION_BODY)
# The head at the end of the text before a line's first bar, and its stamp, named for RE2.
_ARROW_HEAD = _name_groups(r"(?:" + _TS + r"[ \t]*)?" + _HEAD[: -len(r"\|")] + "$", _RAW_COLUMNS[:3])
# strict ISO stamps, which Arrow's cast to timestamp[us] and pandas' ISO8601 parser read alike
_ARROW_ISO = (r"^[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])[ T](?:[01][0-9]|2[0-3])"
              r":[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?$")
def _body_columns(text: str) -> tuple[list, int]:
    """(columns of the body groups, candidate count) for every iteration line of ``text``.

    (A strict one-layout pattern was tried as a fast path: no faster than this one, whose
    optional fields cost little when present.)
    """
    rows = _BODY_RE.findall(text)
    candidates = len(_ITERATION_CANDIDATE_RE.findall(text))
    return (list(zip(*rows)) if rows else [() for _ in _RAW_COLUMNS[1:]]), candidates


def _arrow_float(col) -> tuple[np.ndarray, np.ndarray] | None:
    """(float64 values, present mask) of an Arrow string column; '' is absent (NaN).

    Arrow's cast reads what it accepts exactly as ``float()`` and ``pd.to_numeric`` do. None if
    it refuses a value (``1_000``, garbage): the chunk then takes the ``re`` path, whose
    conversion is the reference (``float()`` for a column, or ``pd.to_numeric`` if that fails).
    """
    empty = pc.equal(col, "")
    present = ~empty.to_numpy(zero_copy_only=False)
    try:
        vals = pc.cast(pc.if_else(empty, pa.scalar(None, col.type), col) if not present.all() else col,
                       pa.float64())
        return vals.to_numpy(zero_copy_only=False).astype("float64", copy=False), present
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OverflowError):
        return None


def _arrow_time(col) -> pd.Series:
    n = len(col)
    if n and pc.all(pc.match_substring_regex(pc.replace_substring(col, ",", "."), _ARROW_ISO)).as_py():
        try:
            ts = pc.cast(pc.replace_substring(col, ",", "."), pa.timestamp("us"))
            return pd.Series(ts.to_numpy(zero_copy_only=False), dtype="datetime64[us]")
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass
    return _to_time(col.to_pylist())


def _canonical_re() -> str:
    """Lines whose fields are read by splitting on bars (checked by RE2's DFA, no groups).

    The text before the first bar ends with the iteration head, and every later bar-closed
    segment is ``[ \t]*key[ \t]*value[ \t]*`` of a known field, keys in Megatron's order.
    On such a line _BODY_RE takes each field from its segment without skipping (the first
    path it tries; all its groups are optional, so that path matches), cannot find an
    absent field (a key only matches right after a bar, in a bar-closed segment), and the
    head is the line's only one (a value has no blanks, so no head hides in a segment).
    """
    out = r"^[^|]*" + _HEAD.replace("(", "(?:")
    for key, v in _FIELDS:
        value = r"[ \t]*[^ \t|%]*%[ \t]*\|" if v == _MFU_V else r"[ \t]*[^ \t|]*[ \t]*\|"
        out += rf"(?:[ \t]*{key}{value})?"
    return out + r"[^|]*$"


_CANONICAL = _canonical_re()
# on a canonical line a segment's key is known by its length (all differ; lm-loss = lm loss)
_KEY_BY_LEN = np.full(64, -1, dtype="int64")
for _i, (_key, _) in enumerate(_FIELDS):
    _KEY_BY_LEN[len(_key.replace("\\", "").replace("[ -]", " ")) - 1] = _i  # length without the colon
assert (_KEY_BY_LEN >= 0).sum() == len(_FIELDS)
_MFU = [k for k, _ in _FIELDS].index("MFU:")


def _split_canonical(lines):
    """(head struct, candidate count, field index, value and line of each segment) of canonical lines."""
    pieces = pc.split_pattern(lines, "|")
    seg0 = pc.list_element(pieces, 0)
    head = pc.extract_regex(seg0, _ARROW_HEAD)
    counts = pc.list_value_length(pieces).to_numpy(zero_copy_only=False).astype("int64")
    starts = np.cumsum(counts) - counts
    flat = pieces.flatten()
    # "iteration N/" can stand before the head or after the last bar, nowhere else
    ends = pa.concat_arrays([seg0.cast(flat.type), flat.take(pa.array(starts + counts - 1))])
    candidates = int(pc.sum(pc.count_substring_regex(ends, _ITERATION_CANDIDATE_RE.pattern)).as_py() or 0)
    line_of = np.repeat(np.arange(len(counts)), counts)
    local = np.arange(len(flat)) - starts[line_of]
    mid = (local >= 1) & (local < counts[line_of] - 1)  # bar-closed segments after the head's bar
    segs = pc.utf8_ltrim(flat.filter(pa.array(mid)), characters=" \t")
    kv = pc.split_pattern(segs, ":", max_splits=1).flatten()  # key, value: two pieces each
    even = np.arange(0, len(kv), 2)
    fid = _KEY_BY_LEN[pc.utf8_length(kv.take(pa.array(even))).to_numpy(zero_copy_only=False).astype("int64")]
    value = pc.utf8_trim(kv.take(pa.array(even + 1)), characters=" \t")
    return head, candidates, fid, value, line_of[mid]


def _arrow_columns(text: str, offsets: bool):
    """The iteration columns of ``text`` from pyarrow's compute kernels, or None for the re path.

    The same rows as the ``re`` path: every pattern is confined to one line, so the text's
    matches are its lines' matches. Lines are split and filtered in Arrow; canonical lines
    (:func:`_canonical_re`, nearly all of a real log) are read by splitting on bars, the rest
    by ``_LINE_RE``. Chunks with a line holding two iteration heads (ranks interleaved: two
    rows from one line), chunks mixing stamped and unstamped lines, and text Arrow cannot
    encode (lone surrogates) return None. (RE2's ``extract_regex`` with _BODY_RE's lazy
    optional fields was 30x slower than ``re``; its literal and DFA kernels are fast.)
    Returns (timestamps, {column: float64}, {column: present}, starts or None, candidates).
    """
    if pa is None or "iteration" not in text:
        return None
    # The system allocator: with the default (mimalloc) a 200 MB log took 1.5x the CPU time,
    # page faults on the large short-lived buffers. Buffers free into the pool they came from.
    pool = pa.default_memory_pool()
    pa.set_memory_pool(_SYSTEM_POOL)
    try:
        return _arrow_columns_in(text, offsets)
    finally:
        pa.set_memory_pool(pool)


def _arrow_columns_in(text: str, offsets: bool):
    try:
        arr = pa.array([text], pa.large_string())
    except (UnicodeEncodeError, pa.ArrowException):
        return None
    lines = pc.split_pattern(arr, "\n").flatten()
    del arr
    mask = pc.match_substring(lines, "iteration")
    cand = lines.filter(mask)
    canon = pc.match_substring_regex(cand, _CANONICAL).to_numpy(zero_copy_only=False)
    other = cand.filter(pa.array(~canon))
    heads = np.ones(len(cand), dtype="int64")
    heads[~canon] = pc.count_substring_regex(other, _HEAD).to_numpy(zero_copy_only=False)
    if (heads > 1).any():
        return None
    candidates = int(pc.sum(pc.count_substring_regex(other, _ITERATION_CANDIDATE_RE.pattern)).as_py() or 0)
    head, c_cand, fid, value, seg_line = _split_canonical(cand.filter(pa.array(canon)))
    candidates += c_cand
    has = heads == 1
    n = int(has.sum())
    canonical = canon[has]  # per row: read from segments, or by _LINE_RE
    row_of_canon = np.flatnonzero(canonical)  # canonical line k is row row_of_canon[k]
    rest = np.flatnonzero(~canonical)
    rest_rows = [_LINE_RE.search(s).groups() for s in cand.filter(pa.array(has & ~canon)).to_pylist()]
    rest_cols = list(zip(*rest_rows)) if rest_rows else [() for _ in _RAW_COLUMNS]
    empty = pa.array([""], pa.large_string())
    raw = {}
    for j, c in enumerate(_RAW_COLUMNS):
        idx = np.full(n, -1, dtype="int64")
        if j < 3:
            src = head.field(c).cast(pa.large_string())
            idx[row_of_canon] = np.arange(len(row_of_canon))
        else:
            sel = fid == j - 3
            src = value.filter(pa.array(sel)).cast(pa.large_string())
            if j - 3 == _MFU:
                src = pc.utf8_rtrim(src, characters="%")  # the value has no % of its own
            idx[row_of_canon[seg_line[sel]]] = np.arange(len(src))
        alls = pa.concat_arrays([src, pa.array(rest_cols[j], pa.large_string()), empty])
        idx[rest] = len(src) + np.arange(len(rest))
        idx[idx < 0] = len(alls) - 1
        raw[c] = pc.fill_null(alls.take(pa.array(idx)), "")  # an unmatched optional group: ''
    stamps = raw.pop("timestamp")
    n_stamped = n - int(pc.sum(pc.equal(stamps, "")).as_py() or 0)
    if n_stamped == 0:
        ts = _to_time([""] * n)
    elif n_stamped == n:
        ts = _arrow_time(stamps)
    else:
        return None
    vals, present = {}, {}
    for c, col in raw.items():
        got = _arrow_float(col)
        if got is None:
            return None
        vals[c], present[c] = got
    starts = None
    if offsets:
        # a line's start: the lengths of the lines before it plus one newline each (in str
        # characters, as re's match.start(); bytes equal characters for ASCII text)
        ascii_ = text.isascii()
        length = pc.binary_length if ascii_ else pc.utf8_length
        lens = length(lines).to_numpy(zero_copy_only=False).astype("int64") + 1
        line_start = np.cumsum(lens) - lens
        idx = np.flatnonzero(mask.to_numpy(zero_copy_only=False))[has]
        body = cand.filter(pa.array(has))
        if ascii_:
            pos = pc.find_substring_regex(body, _HEAD).to_numpy(zero_copy_only=False)
        else:
            pre = pc.extract_regex(body, r"^(?P<pre>.*?)" + _HEAD.replace("(", "(?:")).field("pre")
            pos = pc.utf8_length(pre).to_numpy(zero_copy_only=False)
        starts = (line_start[idx] + pos.astype("int64")).tolist()
    return ts, vals, present, starts, candidates


def parse_iteration_text(text: str, *, source: str = "", job_id: str | None = None,
                         rank: int | None = None, offsets: bool = False,
                         base_offset: int = 0) -> tuple[pd.DataFrame, int]:
    """Iteration rows of ``text`` (any mix of lines) and the count of unreadable ones.

    A row needs an iteration number and either the elapsed time or the loss; a line that
    says ``iteration N/`` but yields neither (cut off, interleaved with another rank's
    output, numbers out of range) counts as skipped. Values Megatron prints as ``nan`` or
    ``inf`` stay NaN/inf: they are data (a NaN loss is an interruption cause), not errors.
    ``offsets=True`` adds each line's byte offset (``base_offset`` + position), to order
    rows against error and checkpoint lines.

    With pyarrow, the lines are split and matched in Arrow's RE2 kernels
    (:func:`_arrow_columns`); the ``re`` code below is the reference and the fallback.
    """
    fast = _arrow_columns(text, offsets)
    if fast is not None:
        ts, vals, present, starts, candidates = fast
        n = len(ts)
        starts = starts if starts is not None else []
    else:
        ts, vals, present, starts, candidates, n = _re_columns(text, offsets)
    df = pd.DataFrame(
        {
            "source": np.full(n, source, dtype=object),
            "job_id": np.full(n, job_id, dtype=object),
            "rank": np.full(n, rank, dtype=object),
            "seq": np.arange(n, dtype="int64"),
            "offset": (np.asarray(starts, dtype="int64") + base_offset) if len(starts) == n
            else np.full(n, -1, dtype="int64"),
            "timestamp": ts,
            **vals,
        }
    )
    # a loss or grad norm printed as nan/inf (not merely absent, as on fp16 skipped steps)
    nonfinite = np.zeros(n, dtype=bool)
    for c in ("lm_loss", "grad_norm"):
        nonfinite |= ~np.isfinite(vals[c]) & present[c]
    df["nonfinite"] = nonfinite
    ok = (
        df["iteration"].notna()
        & (df["iteration"].abs() < _INT_LIMIT)
        & (df["elapsed_ms"].notna() | df["lm_loss"].notna())
    )
    df = df[ok].reset_index(drop=True)
    df["iteration"] = df["iteration"].astype("int64")
    skipped = max(candidates - len(df), 0)
    return df[ITERATION_COLUMNS], skipped


def _re_columns(text: str, offsets: bool):
    """The columns from Python's ``re`` (no pyarrow, or a chunk :func:`_arrow_columns` declines)."""
    starts: list[int] = []
    if offsets:
        found = [(m.start(),) + m.groups() for m in _BODY_RE.finditer(text)]
        starts = [f[0] for f in found]
        body = list(zip(*[f[1:] for f in found])) if found else [() for _ in _RAW_COLUMNS[1:]]
        candidates = len(_ITERATION_CANDIDATE_RE.findall(text))
    else:
        body, candidates = _body_columns(text)
    n = len(body[0])
    stamps = _TS_RE.findall(text) if n and "[" in text else []
    if len(stamps) == n:
        cols = [stamps] + body
    elif not stamps:
        cols = [("",) * n] + body
    else:  # some lines with, some without a timestamp: match line by line
        found = [(m.start(),) + m.groups() for m in _ITERATION_RE.finditer(text)]
        starts = [f[0] for f in found]
        cols = list(zip(*[f[1:] for f in found])) if found else [() for _ in _RAW_COLUMNS]
        n = len(cols[0])
    vals = {c: _to_float(v) for c, v in zip(_RAW_COLUMNS[1:], cols[1:])}
    present = {c: np.array([bool(x) for x in cols[_RAW_COLUMNS.index(c)]], dtype=bool)  # '' or None: absent
               for c in ("lm_loss", "grad_norm")}
    return _to_time(cols[0]), vals, present, starts, candidates, n


def parse_iteration_lines(lines: pd.Series | list[str], **ids) -> tuple[pd.DataFrame, int]:
    """:func:`parse_iteration_text` over a Series (or list) of lines."""
    text = "\n".join(pd.Series(lines, dtype=object).fillna("").astype(str).tolist())
    return parse_iteration_text(text, **ids)


def _parse_range(path: str, start: int, end: int | None, chunk_bytes: int, job_id, rank,
                 offsets: bool) -> tuple[list[pd.DataFrame], int]:
    frames, skipped = [], 0
    for off, text in iter_text_chunks(path, chunk_bytes, start, end):
        df, sk = parse_iteration_text(text, source=str(path), job_id=job_id, rank=rank,
                                      offsets=offsets, base_offset=off)
        frames.append(df)
        skipped += sk
    return frames, skipped


def parse_iterations_file(path: str | os.PathLike, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                          job_id: str | None = None, rank: int | None = None,
                          offsets: bool = False, workers: int = 1) -> tuple[pd.DataFrame, int]:
    """All iteration rows of one log file, read in newline-cut chunks (bounded memory).

    ``job_id``/``rank`` default to what the file name says (:func:`source_ids`).
    ``workers > 1`` parses line-aligned byte ranges in that many processes (the regex work
    is CPU-bound and holds the GIL); memory grows by about one chunk per worker.
    """
    fj, fr = source_ids(path)
    job_id = job_id if job_id is not None else fj
    rank = rank if rank is not None else fr
    if workers > 1 and os.path.getsize(path) > chunk_bytes:
        from concurrent.futures import ProcessPoolExecutor

        ranges = line_ranges(path, workers)
        with ProcessPoolExecutor(max_workers=workers) as ex:
            futs = [ex.submit(_parse_range, str(path), a, b, chunk_bytes, job_id, rank, offsets) for a, b in ranges]
            results = [f.result() for f in futs]
        frames = [df for fr_, _ in results for df in fr_]
        skipped = sum(sk for _, sk in results)
    else:
        frames, skipped = _parse_range(str(path), 0, None, chunk_bytes, job_id, rank, offsets)
    if not frames:
        return parse_iteration_text("", source=str(path), job_id=job_id, rank=rank)
    out = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
    out["seq"] = np.arange(len(out), dtype="int64")
    return out, skipped


def parse_checkpoint_text(text: str, *, source: str = "", job_id: str | None = None,
                          rank: int | None = None, base_offset: int = 0) -> tuple[pd.DataFrame, int]:
    """Checkpoint lines: ``kind`` is save (started), saved (committed), load or loaded.

    Megatron prints ``saving checkpoint at iteration N to PATH``, ``successfully saved
    checkpoint from iteration N to PATH`` (``at`` in older versions), ``loading checkpoint
    from PATH at iteration N`` and ``successfully loaded checkpoint from PATH ... at
    iteration N``. A save without its "saved" is a torn checkpoint; a "loaded" marks the
    step a restart resumed from. ``offset`` is the position in the file, to order these
    against error lines. ``skipped`` is always 0: a garbled checkpoint line is just not one.
    """

    recs = []
    for m in (m for st, en in candidate_lines(text, ("checkpoint",)) for m in _CHECKPOINT_RE.finditer(text, st, en)):
        g = m.groupdict()
        for kind in ("save", "saved", "load", "loaded"):
            if g[kind]:
                it = g[f"{kind}_it"]
                recs.append((source, job_id, rank, base_offset + m.start(), kind,
                             int(it) if len(it) < 16 else None, g.get(f"{kind}_path")))
                break
    return pd.DataFrame(recs, columns=CHECKPOINT_COLUMNS), 0
