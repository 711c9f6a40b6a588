"""``python tests/megatron_logits.py OUT.npz RUN_DIR:STEP ...``: the Megatron model's own forward on the export's
probe batch, for each checkpoint (loaded into one TP1/PP1 model in this process), as fp32 numpy arrays."""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main(out: str, *runs: str) -> None:
    import numpy as np

    from launch.compose import load_job
    from train import hf_bridge
    from train.export import probe_tokens

    arrays = {}
    with hf_bridge.one_process():
        for spec in runs:
            run_dir, step = spec.rsplit(":", 1)
            job = load_job(Path(run_dir) / "config.yaml")
            chunk = hf_bridge.load_checkpoint_model(job, job.paths_at(run_dir).checkpoint(int(step)))
            tokens = probe_tokens(job.model)
            arrays[f"{Path(run_dir).name}_tokens"] = tokens.numpy()
            arrays[f"{Path(run_dir).name}_logits"] = hf_bridge.megatron_logits(chunk, tokens).numpy()
    np.savez(out, **arrays)


if __name__ == "__main__":
    main(*sys.argv[1:])
