"""The padded vocabulary size slurmtron's runs use (pure; shared by the check, the planner and the worker).

Megatron-LM pads to a multiple of ``make_vocab_size_divisible_by * tp``, so the embedding's
shape changes with tp and a checkpoint saved under TP2 cannot be loaded under TP1 or TP8.
slurmtron pads to the least common multiple of ``make_vocab_size_divisible_by`` and ``tp``
instead: the same shape in every layout whose tp divides the multiple, which keeps
resharding on resume possible. (``analysis.flops.pad_vocab_size`` keeps Megatron-LM's rule,
for reading logs of runs that used it.)
"""
from __future__ import annotations

import math


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """``vocab_size`` rounded up to a multiple of lcm(divisible_by, tp)."""
    if divisible_by < 1 or tp < 1:
        raise ValueError(f"make_vocab_size_divisible_by ({divisible_by}) and tp ({tp}) must be >= 1")
    multiple = divisible_by * tp // math.gcd(divisible_by, tp)
    return math.ceil(vocab_size / multiple) * multiple


def padding_multiple(divisible_by: int, tp: int) -> int:
    return divisible_by * tp // math.gcd(divisible_by, tp)
