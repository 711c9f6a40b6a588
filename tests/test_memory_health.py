"""Memory health without a GPU (train/memory.py): the GPU path through fakes of ``torch.cuda.memory_stats()``, the
fragmentation rule on fake sequences, the OOM forensics with an injected summary, and the planner's memory plan."""
from __future__ import annotations

import json

import torch

from launch.compose import compose_job
from launch.paths import RunPaths
from launch.planner.memory import memory_plan
from train import memory
from train.memory import GIB, MIB, FragmentationWatch, MemorySample
from train.tracking import NAMES


def _stats(allocated: float, reserved: float, peak: float = 0.0, retries: int = 0) -> dict:
    """The keys of torch.cuda.memory_stats() that train/memory.py reads (the real dict has ~100 more)."""
    return {"allocated_bytes.all.current": int(allocated), "reserved_bytes.all.current": int(reserved),
            "allocated_bytes.all.peak": int(peak or allocated), "num_alloc_retries": retries,
            "active_bytes.all.current": int(allocated), "num_ooms": 0}


def test_a_gpu_sample_reads_cudas_allocator_statistics_and_the_cpu_its_rss():
    s = memory.sample(True, stats=lambda: _stats(3 * GIB, 5 * GIB, 4 * GIB, 2))
    assert (s.allocated, s.reserved, s.peak, s.gap, s.retries, s.rss) == (3 * GIB, 5 * GIB, 4 * GIB, 2 * GIB, 2, None)
    assert memory.log_line(3, 10, s) == ("[Rank 3] (after 10 iterations) memory (MB) | allocated: 3072.00 | max "
                                         "allocated: 4096.00 | reserved: 5120.00 | gap: 2048.00 | alloc retries: 2 | "
                                         "rss: n/a")
    cpu = memory.sample(False, rss=lambda: 100 * MIB)
    assert cpu.fields() == {"mem_rss": 100 * MIB} and cpu.gap is None
    assert memory.log_line(0, 1, cpu).endswith("gap: n/a | alloc retries: n/a | rss: 100.00")
    scal = memory.scalars(s, plan_bytes=6 * GIB)
    assert scal["mem_gap"] == 2 * GIB and scal["mem_planner_estimate"] == 6 * GIB and "mem_rss" not in scal
    assert all(k in NAMES for k in scal)  # every scalar has its TensorBoard tag


def test_fragmentation_is_a_gap_that_grows_over_the_window_or_retries_that_rise():
    w = FragmentationWatch(window=4, min_growth=256 * MIB, min_fraction=0.05)
    steady = [w.add(i, memory.from_stats(_stats(10 * GIB, 12 * GIB))) for i in range(1, 9)]
    assert steady == [None] * 8  # a large but constant gap is no growth
    w = FragmentationWatch(window=4)
    gaps = [1.0, 1.4, 1.9, 2.5]  # GiB: grows at every sample, 1.5 GiB in all > max(256 MiB, 5% of 12.5 GiB)
    found = [w.add(i, memory.from_stats(_stats(10 * GIB, (10 + g) * GIB))) for i, g in enumerate(gaps, 1)]
    assert found[:3] == [None] * 3 and found[3]["symptom"] == "gap" and found[3]["first_step"] == 1
    assert "1.00 -> 2.50 GiB over steps 1..4" in found[3]["detail"]
    assert w.add(5, memory.from_stats(_stats(10 * GIB, 12.6 * GIB))) is None  # one episode, one event
    w = FragmentationWatch(window=4)
    wobbly = [1.0, 1.6, 1.2, 2.5]  # not growing at every sample: a transient, not fragmentation
    assert [w.add(i, memory.from_stats(_stats(10 * GIB, (10 + g) * GIB))) for i, g in enumerate(wobbly)] == [None] * 4
    w = FragmentationWatch(window=3)
    out = [w.add(i, memory.from_stats(_stats(10 * GIB, 11 * GIB, retries=r))) for i, r in enumerate([0, 0, 3])]
    assert out[2]["symptom"] == "alloc_retries" and "0 -> 3" in out[2]["detail"]
    assert FragmentationWatch(window=2).add(1, MemorySample(rss=1.0)) is None  # the CPU says nothing


def test_an_oom_writes_the_summary_and_the_snapshot_and_one_line_with_the_plan(tmp_path):
    paths = RunPaths.of(tmp_path / "r")
    dumped = []
    files = memory.oom_files(paths, "812", 2, 5, cuda=True, snapshot=True, summary=lambda: "|| PyTorch CUDA memory",
                             dump=lambda p: dumped.append(p) or open(p, "wb").close())
    assert [f.name for f in files] == ["812_2_rank5.memory_summary.txt", "812_2_rank5.snapshot.pickle"]
    assert files[0].parent == tmp_path / "r" / "oom" and files[0].read_text() == "|| PyTorch CUDA memory"
    assert dumped == [str(files[1])]
    cpu = memory.oom_files(paths, None, 0, 0, cuda=False, snapshot=True, s=MemorySample(rss=MIB))
    assert [f.name for f in cpu] == ["local_0_rank0.memory_summary.txt"] and "rss: 1.00" in cpu[0].read_text()

    job = compose_job(["cluster=lustre", "model=7b", "parallelism.recompute=none"])
    plan = json.loads(json.dumps(memory_plan(job)))  # what memory_plan.json holds
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    assert memory.read_plan(tmp_path / "plan.json")["total_gib"] == plan["total_gib"]
    assert memory.read_plan(tmp_path / "missing.json") is None
    line = memory.forensics_line("OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\nmore",
                                 MemorySample(peak=70 * GIB), plan)
    assert line.startswith("out of GPU memory (OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB); "
                           "measured peak allocated 70.00 GiB; planner estimate ")
    assert "weights" in line and "activations" in line and "fix: parallelism.recompute=selective" in line
    assert memory.is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory."))
    assert memory.is_oom(RuntimeError("CUDA out of memory. Tried to allocate")) and not memory.is_oom(ValueError("x"))
