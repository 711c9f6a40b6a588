"""Megatron-LM's validation lines: `` validation loss at iteration N | lm loss value: X | lm loss PPL: Y |``.

Printed by Megatron-LM's ``evaluate_and_print_results`` (and by slurmtron's worker in the same format),
between two lines of dashes. Other loss keys on the same line (``... | mtp_1 loss value: ...``) are ignored.
"""
from __future__ import annotations

import os
import re

import pandas as pd

from analysis.parse_megatron import read_text

__all__ = ["VALIDATION_COLUMNS", "parse_validation_text", "parse_validation_file"]

VALIDATION_COLUMNS = ["source", "iteration", "val_loss", "val_ppl"]
_LINE = re.compile(r"validation loss at (?:iteration )?(\d+)\s*\|\s*lm loss value:\s*([-+0-9.eEnaNinf]+)"
                   r"(?:\s*\|\s*lm loss PPL:\s*([-+0-9.eEnaNinf]+))?")


def parse_validation_text(text: str, *, source: str = "") -> pd.DataFrame:
    """One row per validation line, in order of appearance (a resumed run may repeat an iteration)."""
    rows = []
    for m in _LINE.finditer(text):
        loss = float(m.group(2))
        ppl = float(m.group(3)) if m.group(3) else float("nan")
        rows.append((source, int(m.group(1)), loss, ppl))
    return pd.DataFrame(rows, columns=VALIDATION_COLUMNS)


def parse_validation_file(path: str | os.PathLike) -> pd.DataFrame:
    return parse_validation_text(read_text(path), source=str(path))
