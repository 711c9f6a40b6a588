"""The data sources of a job: ``data.path`` or a weighted ``data.blend`` (pure; shared by the check and the ranks).

``data.blend`` takes either a list of ``{path, weight}`` entries or Megatron-LM's flat string
(``"0.3 data/web 0.7 data/code"``, as ``--data-path``). ``data.valid_blend`` (same forms) draws
the validation split from other files (Megatron's ``blend_per_split``); ``data.split`` then no
longer applies: every training prefix is used whole. Relative prefixes are under
``cluster.data_root`` when it is set.

Also here, the arithmetic the check shows: which documents of a prefix fall into the train split
(Megatron's rounding), how many samples the blend builds from each source (Megatron's
``ceil(ceil(n * w) * (1 + surplus))``) and how many tokens, hence epochs, that takes.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Sequence, Tuple

MID_LEVEL_SURPLUS = 0.005  # Megatron-Core's GPTDatasetConfig.mid_level_dataset_surplus default


class BlendError(ValueError):
    """A ``data.blend`` that cannot be read; ``field`` names the entry."""

    def __init__(self, field: str, message: str, fix: str) -> None:
        super().__init__(f"{field}: {message} ({fix})")
        self.field, self.message, self.fix = field, message, fix


@dataclass(frozen=True)
class Source:
    """One prefix of a blend: its resolved path, its weight as written and the field that set it."""

    path: str
    weight: float
    field: str

    @property
    def name(self) -> str:
        return os.path.basename(self.path) or self.path


def _entries(value: Any, field: str) -> List[Tuple[Any, Any, str]]:
    """(weight, path, field) per entry of a string or list blend, unvalidated."""
    if isinstance(value, str):
        words = value.split()
        if len(words) % 2:
            raise BlendError(field, f"Megatron's flat form alternates weight and prefix; {len(words)} words",
                             f"write e.g. {field}='0.3 data/web 0.7 data/code'")
        return [(words[i], words[i + 1], f"{field}[{i // 2}]") for i in range(0, len(words), 2)]
    if isinstance(value, Sequence):
        out = []
        for i, item in enumerate(value):
            if not isinstance(item, Mapping) or set(item) - {"path", "weight"} or "path" not in item:
                raise BlendError(f"{field}[{i}]", f"expected {{path, weight}}, got {item!r}",
                                 f"write {field}=[{{path: data/web, weight: 0.3}}, ...]")
            out.append((item.get("weight", 1.0), item["path"], f"{field}[{i}]"))
        return out
    raise BlendError(field, f"expected a list of {{path, weight}} or a string, got {type(value).__name__}",
                     f"write {field}='0.3 data/web 0.7 data/code'")


def parse_blend(value: Any, field: str = "data.blend", data_root: str = "") -> List[Source]:
    """The sources of one blend value (``[]`` for None or empty); raises :class:`BlendError`."""
    if value is None or (isinstance(value, (str, Sequence)) and len(value) == 0):
        return []
    sources = []
    for weight, path, where in _entries(value, field):
        try:
            w = float(weight)
        except (TypeError, ValueError):
            raise BlendError(where, f"weight {weight!r} is not a number",
                             "weights come first in the flat form: '0.3 data/web 0.7 data/code'") from None
        if not math.isfinite(w) or w <= 0:
            raise BlendError(where, f"weight {weight!r} must be a positive number",
                             f"set a weight > 0 or drop the entry from {field}")
        path = str(path).strip()
        if not path or re.search(r"[\n\r\0]", path):
            raise BlendError(where, f"prefix {path!r} is empty or not a single line", "give the .bin/.idx prefix")
        if data_root and not os.path.isabs(path):
            path = os.path.join(data_root, path)
        sources.append(Source(path, w, where))
    return sources


def train_sources(data: Any, data_root: str = "") -> List[Source]:
    """The training sources of ``data`` (a :class:`launch.config.DataConfig`): ``data.blend`` or ``data.path``."""
    blend = parse_blend(data.blend, "data.blend", data_root)
    if blend and data.path:
        raise BlendError("data.path", "data.path and data.blend are both set",
                         "set data.path='' (data.blend names every prefix) or drop data.blend")
    if blend:
        return blend
    if data.path:
        path = data.path if not data_root or os.path.isabs(data.path) else os.path.join(data_root, data.path)
        return [Source(path, 1.0, "data.path")]
    return []


def valid_sources(data: Any, data_root: str = "") -> List[Source]:
    """``data.valid_blend``'s sources; ``[]`` means the validation split comes from ``data.split``."""
    return parse_blend(data.valid_blend, "data.valid_blend", data_root)


def normalized(sources: Sequence[Source]) -> List[float]:
    total = sum(s.weight for s in sources)
    return [s.weight / total for s in sources]


def megatron_blend(sources: Sequence[Source]) -> Optional[Tuple[List[str], Optional[List[float]]]]:
    """Megatron-Core's ``(prefixes, weights)``; weights None for one source (a plain GPTDataset, no blending)."""
    if not sources:
        return None
    return [s.path for s in sources], (None if len(sources) == 1 else [s.weight for s in sources])


def split_fractions(split: str) -> List[float]:
    """``data.split`` ("99,1,0") normalized as Megatron does; raises ValueError when it is not three weights >= 0."""
    parts = [float(x) for x in re.findall(r"[.0-9]+", split)]
    parts += [0.0] * (3 - len(parts))
    if len(parts) != 3 or sum(parts) <= 0:
        raise ValueError(f"data.split={split!r}: expected up to three non-negative weights, e.g. 99,1,0")
    total = sum(parts)
    return [p / total for p in parts]


def split_range(fractions: Sequence[float], index: int, documents: int) -> Tuple[int, int]:
    """Documents ``[begin, end)`` of split ``index`` (0 train, 1 valid): Megatron's ``round(bound * n)``."""
    begin = sum(fractions[:index])
    end = begin + fractions[index]
    return int(round(begin * float(documents))), int(round(end * float(documents)))


def samples_per_source(sources: Sequence[Source], num_samples: int,
                       surplus: float = MID_LEVEL_SURPLUS) -> List[int]:
    """Samples Megatron builds from each source for a blend of ``num_samples``: ceil(ceil(n * w) * (1 + surplus))."""
    if len(sources) == 1:
        return [num_samples]
    return [int(math.ceil(math.ceil(num_samples * w) * (1 + surplus))) for w in normalized(sources)]


def epochs_needed(samples: int, seq_length: int, split_tokens: int) -> int:
    """Passes over a split of ``split_tokens`` tokens that ``samples`` sequences need (Megatron's
    GPTDataset: ``samples * seq_length + 1`` tokens); 0 when the split is empty."""
    if split_tokens <= 0:
        return 0
    return max(1, math.ceil((samples * seq_length + 1) / split_tokens))
