"""Whose checkpoint is it: the run's identity, written into every manifest.

A run is its name plus a *run id*: a random id created once, together with the run directory
(``<run_dir>/run_id``, by ``launch/pretrain.py`` or, for a directory made some other way, by
the first attempt's rank 0). A run directory deleted and made again under the same name gets a
new id, so the checkpoints of the old run, still sitting in a shared ``checkpoint_root``, are
recognised as somebody else's. The model shape completes the identity: a checkpoint of another
shape can never be loaded into this model.

Standard library and the run paths only: the login node writes the id.
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any, Optional

from launch.paths import RUN_ID as RUN_ID_FILE


def read_run_id(run_dir: Path) -> Optional[str]:
    try:
        text = (Path(run_dir) / RUN_ID_FILE).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    return text or None


def ensure_run_id(run_dir: Path) -> str:
    """The run's id, creating it (atomically: the first creator wins) if the run has none yet."""
    run_dir = Path(run_dir)
    existing = read_run_id(run_dir)
    if existing:
        return existing
    run_dir.mkdir(parents=True, exist_ok=True)
    new = uuid.uuid4().hex
    tmp = run_dir / f"{RUN_ID_FILE}.{new}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(new + "\n")
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, run_dir / RUN_ID_FILE)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    return read_run_id(run_dir) or new


def model_shape(model: Any) -> dict:
    """The fields of ``model`` that fix the tensors' shapes (a checkpoint of another shape cannot load)."""
    return {
        "name": model.name, "num_layers": model.num_layers, "hidden_size": model.hidden_size,
        "ffn_hidden_size": model.ffn_hidden_size, "num_attention_heads": model.num_attention_heads,
        "num_query_groups": model.num_query_groups, "seq_length": model.seq_length, "vocab_size": model.vocab_size,
        "num_experts": model.num_experts,
    }


def run_identity(job: Any, run_dir: Path) -> dict:
    """``{"name", "id", "model"}`` of the run ``job`` in ``run_dir`` (creates the id if missing)."""
    return {"name": job.run.name, "id": ensure_run_id(run_dir), "model": model_shape(job.model)}
