"""The report as a list of blocks, written out twice: ``report.md`` and a self-contained ``report.html``.

Blocks are plain tuples so the report builder stays declarative:

* ``("h", level, text)``                      a heading
* ``("cards", [(label, value, note)])``       the header's key numbers (a list in markdown)
* ``("ul", [text, ...])``                     a bullet list
* ``("p", text)``                             a paragraph
* ``("table", DataFrame, caption)``           a table; numbers made readable by :func:`readable`
* ``("img", Path, caption)``                  a figure (inline base64 PNG in the HTML)

Numbers are rounded to significant digits with units (``1.45 s``, ``41.3%``, ``354 tokens/s``);
missing values print as an em dash, never ``nan``.
"""
from __future__ import annotations

import base64
import html
import math
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

DASH = "\u2014"


def num(v: Any, sig: int = 3) -> str:
    """``v`` to ``sig`` significant digits with thousands separators (``12,345``, ``0.000235``)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return DASH if v is None or v is pd.NA else str(v)
    if math.isnan(f) or math.isinf(f):
        return DASH
    if f == 0:
        return "0"
    if abs(f) >= 10 ** sig:
        return f"{f:,.0f}"
    digits = max(0, sig - 1 - int(math.floor(math.log10(abs(f)))))
    return f"{f:,.{digits}f}"


def pct(v: Any) -> str:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return DASH
    return DASH if math.isnan(f) else f"{num(100 * f)}%"


def duration(seconds: Any) -> str:
    try:
        s = float(seconds)
    except (TypeError, ValueError):
        return DASH
    if math.isnan(s):
        return DASH
    if abs(s) < 120:
        return f"{num(s)} s"
    if abs(s) < 7200:
        return f"{num(s / 60)} min"
    return f"{num(s / 3600)} h"


def counts(d: dict) -> str:
    """``{'preemption': 1, 'node_failure': 2}`` as ``node failure 2, preemption 1`` (or ``none``)."""
    items = [(str(k).replace("_", " "), v) for k, v in (d or {}).items() if v]
    return ", ".join(f"{k} {v}" for k, v in sorted(items)) or "none"


_UNITS = {"_s": " (s)", "_ms": " (ms)", "_h": " (h)"}


_NAMES = {"mfu": "MFU", "hfu": "HFU", "tflops_per_gpu": "TFLOP/s/GPU", "tokens_per_s": "tokens/s",
          "gpu_hours_lost": "GPU-hours lost", "val_loss": "validation loss", "val_ppl": "validation PPL"}


def _header(col: str) -> str:
    if col in _NAMES:
        return _NAMES[col]
    for suffix, unit in _UNITS.items():
        if col.endswith(suffix):
            return col[: -len(suffix)].replace("_", " ") + unit
    return col.replace("_", " ")


def _cell(col: str, v: Any) -> str:
    if v is None or v is pd.NA or v is pd.NaT:
        return DASH
    if isinstance(v, pd.Timestamp):
        return v.strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(v, float) and math.isnan(v):
        return DASH
    if col in ("mfu", "hfu", "goodput"):
        return pct(v)
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if float(v).is_integer() and col not in ("tflops_per_gpu",):
            return f"{int(v):,}"
        return num(v)
    return str(v)


def readable(df: pd.DataFrame, max_rows: int = 50) -> pd.DataFrame:
    """Strings for display: rounded numbers, percentages, dates without nanoseconds, dashes for gaps."""
    df = df.head(max_rows)
    return pd.DataFrame({_header(c): [_cell(c, v) for v in df[c].tolist()] for c in df.columns})


_MD_SPECIAL = "\\`*_{}[]<>()#+!|~"  # what Markdown (CommonMark, GFM tables) may read as markup, escaped with '\\'


def md(text: Any) -> str:
    """``text`` as literal Markdown text: no raw HTML, link, image, emphasis or table cell can come out of it.

    Every string the report shows may come from a user or a log (a run directory's name, an event's
    ``reason`` or ``host``, a hang's suspects), so ``<`` ``>`` ``&`` become entities (a Markdown viewer
    that renders HTML shows them as text) and Markdown's punctuation is backslash-escaped; a line break
    becomes a space, so a value cannot start a new block.
    """
    s = " ".join(str(text).splitlines())
    s = "".join(("\\" + ch) if ch in _MD_SPECIAL else ch for ch in s)
    return s.replace("&", "&amp;").replace("\\<", "&lt;").replace("\\>", "&gt;")


def to_markdown(blocks: Iterable[tuple]) -> str:
    """The blocks as Markdown; every text is escaped with :func:`md` (the markup is only this function's own)."""
    out: list[str] = []
    for b in blocks:
        kind = b[0]
        if kind == "h":
            out += ["#" * b[1] + " " + md(b[2]), ""]
        elif kind == "cards":
            out += [f"- **{md(label)}**: {md(value)}" + (f" ({md(note)})" if note else "")
                    for label, value, note in b[1]] + [""]
        elif kind == "ul":
            out += [f"- {md(item)}" for item in b[1]] + [""]
        elif kind == "p":
            out += [md(b[1]), ""]
        elif kind == "table":
            df = readable(b[1])
            if b[2]:
                out += [f"*{md(b[2])}*", ""]
            if df.empty:
                out += ["_none_", ""]
                continue
            out.append("| " + " | ".join(md(c) for c in df.columns) + " |")
            out.append("|" + "---|" * len(df.columns))
            out += ["| " + " | ".join(md(v) for v in row) + " |" for row in df.itertuples(index=False)]
            out.append("")
        elif kind == "img":
            out += [f"![{md(Path(b[1]).stem)}](<{md_url(Path(b[1]).name)}>)", "", f"*{md(b[2])}*", ""]
    return "\n".join(out) + "\n"


def md_url(name: str) -> str:
    """A file name as a Markdown link destination: percent-encoded, so it cannot close the link or carry a scheme."""
    from urllib.parse import quote

    return quote(name, safe="._-")


_FORMULA_LEAD = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(v: Any) -> Any:
    """A text cell a spreadsheet would run as a formula (``=``, ``+``, ``-``, ``@``, tab, CR first) gets a
    leading ``'``; numbers, and text that reads as a number (``-1.5``), stay as they are."""
    if not isinstance(v, str) or not v.startswith(_FORMULA_LEAD):
        return v
    try:
        float(v)
        return v
    except ValueError:
        return "'" + v


def csv_safe(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with every text cell passed through :func:`csv_cell` (numeric columns untouched)."""
    out = df.copy()
    for col in out.columns:
        if out[col].dtype == object or pd.api.types.is_string_dtype(out[col].dtype):
            out[col] = out[col].map(csv_cell)
    out.columns = [csv_cell(str(c)) for c in out.columns]
    return out


_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;
color:#222;line-height:1.45}
h1{margin-bottom:.2em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.8em}
.cards{display:flex;flex-wrap:wrap;gap:.8em;margin:1em 0}
.card{border:1px solid #ddd;border-radius:8px;padding:.6em .9em;min-width:9em;background:#fafafa}
.card .v{font-size:1.5em;font-weight:600}.card .l{color:#555;font-size:.85em}.card .n{color:#777;font-size:.75em}
table{border-collapse:collapse;margin:.6em 0 1.2em;font-size:.9em}
th,td{border:1px solid #ccc;padding:.3em .6em;text-align:right}th{background:#f0f0f0}
td.t,td:first-child,th:first-child{text-align:left}p.cap{text-align:left;color:#555;margin:.6em 0 0;font-size:.9em}
table + p.cap, p.cap + table{margin-top:.3em}
figure{margin:1em 0}figure img{max-width:100%;border:1px solid #eee}figcaption{color:#555;font-size:.9em}
"""


def _align(cell: str) -> str:
    """Numbers right-aligned (the default), text left-aligned."""
    head = str(cell).lstrip("-")[:1]
    return "" if head.isdigit() or str(cell) == DASH else " class='t'"


def to_html(blocks: Iterable[tuple], title: str) -> str:
    esc = html.escape
    out = [f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)}</title>"
           f"<style>{_CSS}</style></head><body>"]
    for b in blocks:
        kind = b[0]
        if kind == "h":
            out.append(f"<h{b[1]}>{esc(b[2])}</h{b[1]}>")
        elif kind == "cards":
            out.append("<div class='cards'>" + "".join(
                f"<div class='card'><div class='v'>{esc(str(value))}</div><div class='l'>{esc(label)}</div>"
                + (f"<div class='n'>{esc(note)}</div>" if note else "") + "</div>" for label, value, note in b[1])
                + "</div>")
        elif kind == "ul":
            out.append("<ul>" + "".join(f"<li>{esc(item)}</li>" for item in b[1]) + "</ul>")
        elif kind == "p":
            out.append(f"<p>{esc(b[1])}</p>")
        elif kind == "table":
            df = readable(b[1])
            # the caption above the table, not a <caption>: that is as wide as the table, and a one-cell table
            # would wrap it one word per line
            cap = f"<p class='cap'>{esc(b[2])}</p>" if b[2] else ""
            if df.empty:
                out.append(f"{cap}<table><tr><td>none</td></tr></table>")
                continue
            head = "".join(f"<th>{esc(c)}</th>" for c in df.columns)
            rows = "".join("<tr>" + "".join(f"<td{_align(v)}>{esc(str(v))}</td>" for v in row) + "</tr>"
                           for row in df.itertuples(index=False))
            out.append(f"{cap}<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif kind == "img":
            data = base64.b64encode(Path(b[1]).read_bytes()).decode()
            out.append(f"<figure><img alt='{esc(b[2])}' src='data:image/png;base64,{data}'/>"
                       f"<figcaption>{esc(b[2])}</figcaption></figure>")
    out.append("</body></html>\n")
    return "\n".join(out)
