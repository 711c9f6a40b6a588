"""``training.nan_guard``: what a non-finite loss or gradient norm does (read by ``train/nan_guard.py``,
``train/train_loop.py`` and the checkpointer's rollback; checked by :mod:`launch.check_watch`).

Contract module: the ranks read it, so it imports nothing of ours and no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

# A choice field: OmegaConf stores a str (it has no Literal type); the check reads the allowed values
# from the annotation (launch.config.CHOICES) and reports a wrong one with the others in one list.
OnNan = Annotated[str, Literal["stop", "rollback"]]


@dataclass
class NanGuardConfig:
    """The NaN/Inf guard (``train/nan_guard.py``)."""

    on_nan: OnNan = "stop"  # stop (end with reason nan, no requeue) | rollback (reload newest verified checkpoint)
    skip_batches: int = 1  # rollback: global batches skipped from the one that gave the non-finite value
    max_rollbacks: int = 3  # rollback: incidents tolerated per attempt before stopping with reason nan
    hooks: bool = False  # debug: hooks naming the first module/parameter with a non-finite value (slow)
