"""Could the shape of the GEMMs explain the Megatron-Core r0.8 small-model rows? (analysis, not a model term)

``python benchmarks/gemm_shape.py``

The Megatron-LM README attributes the lower MFU of its 1.7B and 7.1B H100 runs to smaller GEMMs
("larger GEMMs have higher arithmetic intensity and are consequently more efficient"). The planner
runs every GEMM at one rate (``peak * cluster.achievable_fraction``), and those two rows come out
too fast. This script computes, for every published row, the GEMM efficiency that two physical
models of a GEMM's shape give, relative to an ideal GEMM at that rate, over the layer's twelve
GEMM passes per microbatch (QKV, projection, MLP in and out; forward, input gradient, weight
gradient: (M, N, K), (M, K, N), (K, N, M) with M = tokens of the microbatch):

* ``waves``: tile and wave quantization: ``ceil(M/tm) * ceil(N/tn)`` output tiles run in waves of
  one tile per SM; a partly filled last wave costs a full one. SM counts from the vendors'
  whitepapers (A100: 108, H100 SXM: 132); tiles of CUTLASS's default tensor-core kernels (A100
  256 x 128, H100 128 x 256). cuBLAS picks among many tiles and uses stream-K on Hopper, so this
  is an upper bound on the loss.
* ``roofline``: ``max(compute, bytes / HBM)`` with the operands read once and the output written
  once (2 bytes each): the arithmetic-intensity argument of the README.
* ``additive``: waves plus the operand traffic not overlapped at all (a lower bound on efficiency).

Result (printed): under ``waves`` and ``roofline`` the 1.7B and 7.1B rows' GEMMs are as efficient
as the 462B's (0.97 and 1.00: with 4,096 tokens per microbatch every GEMM is compute-bound and
fills the SMs), and even the no-overlap bound separates them by a few percent, not the 12-18% the
rows miss by (Narayanan 2021's A100 rows, at the micro-batches of the authors' script, come out
0.93-0.97 under ``waves`` too). So no shape term is added to the planner.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from launch.planner.shapes import shape_of  # noqa: E402
from launch.planner.steptime import achievable_rate, hbm_bandwidth  # noqa: E402

SMS = {"a100": 108, "h100_sxm": 132}  # NVIDIA A100 and H100 architecture whitepapers
TILE = {"a100": (256, 128), "h100_sxm": (128, 256)}  # CUTLASS default tensor-core tiles (M x N)


def gemm_s(m: int, n: int, k: int, rate: float, hbm: float, gpu: str, mode: str) -> float:
    tm, tn = TILE[gpu]
    tiles = math.ceil(m / tm) * math.ceil(n / tn)
    waves = math.ceil(tiles / SMS[gpu])
    compute = waves * SMS[gpu] * tm * tn * 2 * k / rate if mode != "roofline" else 2 * m * n * k / rate
    memory = 2 * (m * k + k * n + m * n) / hbm
    if mode == "additive":
        return compute + memory
    return max(compute, memory) if mode == "roofline" else compute


def efficiency(job, mode: str) -> float:
    """Ideal GEMM time over modelled GEMM time, for one layer's GEMM passes of one microbatch."""
    p = job.parallelism
    tp = max(1, p.tp)
    sh = shape_of(job.model, tp)
    tokens = job.training.micro_batch_size * sh.seq // max(1, p.cp)
    rate, hbm, gpu = achievable_rate(job), hbm_bandwidth(job.cluster.gpu), job.cluster.gpu
    mlp_in = sh.ffn * (2 if sh.swiglu else 1)
    gemms = [(tokens, (sh.q + 2 * sh.kv) // tp, sh.h), (tokens, sh.h, sh.q // tp),
             (tokens, mlp_in // tp, sh.h), (tokens, sh.h, sh.ffn // tp)]
    ideal = modelled = 0.0
    for m, n, k in gemms:
        for a, b, c in ((m, n, k), (m, k, n), (k, n, m)):  # forward, input gradient, weight gradient
            ideal += 2 * a * b * c / rate
            modelled += gemm_s(a, b, c, rate, hbm, gpu, mode)
    return ideal / modelled


def main() -> int:
    from published_runs import all_rows

    print("| source | run | planner error | waves | roofline | additive |")
    print("|---|---|---:|---:|---:|---:|")
    for r in all_rows():
        if r.metric == "memory_gib" or r.job.cluster.gpu not in SMS:
            continue
        effs = " | ".join(f"{efficiency(r.job, mode):.3f}" for mode in ("waves", "roofline", "additive"))
        print(f"| {r.source} | {r.label} | {100 * r.error():+.1f}% | {effs} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
