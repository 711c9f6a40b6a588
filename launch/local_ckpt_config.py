"""``training.local_checkpoint``: the node-local checkpoint tier's settings (read by ``train/local_ckpt.py`` and
:mod:`recovery.local_sets`; checked by :mod:`launch.check_local_ckpt`).

Every ``interval`` steps each rank writes its own shard of the training state to its node's local directory
(``cluster.local_checkpoint_dir``) and sends it to the ranks of the next ``replication - 1`` nodes of a ring over
the process group; a resume takes the newest complete, verified local set when it is newer than the newest global
checkpoint. Contract module: the ranks read it, so it imports nothing of ours and no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class LocalCheckpointConfig:
    """The local tier (docs/checkpointing.md, "Node-local checkpoints"); off unless ``interval`` > 0."""

    interval: Optional[int] = None  # steps between local saves (None or 0 = off, the default)
    replication: int = 2  # copies of each node's shards: its own plus replication - 1 on the next nodes of the ring
    keep: int = 1  # committed local sets kept per node (1 or 2); older ones are deleted as new ones commit

    @property
    def enabled(self) -> bool:
        return isinstance(self.interval, int) and not isinstance(self.interval, bool) and self.interval > 0
