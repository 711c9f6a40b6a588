"""Published training runs the planner is validated against (test data, one citation per row).

Every row is a layout that was trained and measured by someone else: the model, the layout, the
batch, the hardware, and what they published (step time, TFLOP/s per GPU, or memory per GPU).
The planner estimates each row with *one* set of constants (the schema defaults plus the
hardware profile of the site: GPU, NVLink and network bandwidth as the paper states them);
nothing here is fitted per row. ``tests/test_planner_published.py`` checks the error bounds and
``benchmarks/bench_planner.py`` prints the per-source table for ``benchmarks/RESULTS.md``.

What a metric means:

* ``step_s``: published seconds per optimizer step; compared with the estimated step time.
* ``tflops``: published TFLOP/s per GPU. ``flops`` says whose FLOP count the authors divided by
  their step time: ``"paper"`` = Narayanan et al.'s ``96 B s l h^2 (1 + s/6h + V/16lh)`` (full
  recompute counted, as Megatron-LM and Megatron-DeepSpeed logged it in 2021-22), ``"model"`` =
  the model FLOPs of ``analysis.flops`` (no recompute), ``"model_full_square"`` = the same
  without the causal halving of the attention scores (Megatron-LM's ``training.py`` before core
  0.12, which Megatron-Core r0.8.0's published MFU used). The estimate divides the same count by
  the estimated step time, so only the denominator is ours.
* ``memory_gib``: published measured memory per GPU (worst GPU), GiB.

Layout choices that a source does not state are listed in the row's ``assumed`` text.
"""
from __future__ import annotations

from dataclasses import dataclass

from analysis.flops import flops_breakdown, peak_flops
from launch.config import ClusterConfig, DataConfig, Job, ModelConfig, ParallelismConfig, TrainingConfig
from launch.planner.memory import worst_stage
from launch.planner.shapes import shape_of
from launch.planner.steptime import step_time


@dataclass(frozen=True)
class Published:
    source: str  # short source key (one line of the per-source table)
    cite: str  # paper + table/section
    label: str
    params_b: float  # model size, billions (rows >= 1B carry the accuracy targets)
    job: Job
    metric: str  # step_s | tflops | memory_gib
    value: float
    flops: str = "model"  # for tflops rows: "paper" or "model" (see the module docstring)
    assumed: str = ""
    framework: str = "megatron-core"  # whose memory behaviour (launch.planner.memory.FRAMEWORKS)
    engine: str = "megatron-core"  # whose step-time behaviour (launch.planner.steptime.ENGINES)

    def estimate(self) -> float:
        """The planner's value of this row's metric (same units as ``value``)."""
        if self.metric == "memory_gib":
            return worst_stage(self.job, framework=self.framework).total
        st = step_time(self.job, framework=self.engine)
        if self.metric == "step_s":
            return st.step_time_s
        if self.flops == "paper":
            flops = paper_flops(self.job)
        elif self.flops == "model_full_square":
            flops = sum(flops_breakdown(self.job.model, self.job.training.global_batch_size, causal=False,
                                        padded_vocab_size=shape_of(self.job.model, self.job.parallelism.tp).vocab
                                        ).values())
        else:
            flops = st.model_flops
        return flops / st.step_time_s / self.job.world_size / 1e12

    def error(self) -> float:
        """Signed relative error of the estimate; for TFLOP/s rows expressed on step time (estimated
        step / published step - 1 = published TFLOP/s / estimated - 1), so every speed error has one sign:
        positive = the planner is too slow."""
        est = self.estimate()
        if self.metric == "tflops":
            return self.value / est - 1
        return est / self.value - 1


def paper_flops(job: Job) -> float:
    """Narayanan et al. 2021's FLOPs per step with full recompute: ``96 B s l h^2 (1 + s/6h + V/16lh)``."""
    m = job.model
    b, s, layers, h = job.training.global_batch_size, m.seq_length, m.num_layers, m.hidden_size
    v = shape_of(m, job.parallelism.tp).vocab
    return 96 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))


# --- hardware profiles, as the papers describe the machines -------------------------------------------------

def selene(nodes: int) -> ClusterConfig:
    """DGX A100 80GB (Selene): NVLink 3 (300 GB/s per direction per GPU), 8 x HDR 200 Gb/s per node
    = 25 GB/s per GPU. Narayanan et al. 2021 section 5; Korthikanti et al. 2022 section 6; Smith et al.
    2022 section 2.3."""
    return ClusterConfig(name="selene", nodes=nodes, gpus_per_node=8, gpu="a100", gpu_memory_gb=80,
                         nvlink_bandwidth_gbs=300, ib_bandwidth_gbs=25)


def jean_zay(nodes: int) -> ClusterConfig:
    """Jean Zay A100 80GB partition (BLOOM): 8 A100 per node on NVLink, 4 x Omni-Path 100 Gb/s per node
    = 6.25 GB/s per GPU (BigScience, BLOOM paper section 3.4.1)."""
    return ClusterConfig(name="jean-zay", nodes=nodes, gpus_per_node=8, gpu="a100", gpu_memory_gb=80,
                         nvlink_bandwidth_gbs=300, ib_bandwidth_gbs=6.25)


def grand_teton(nodes: int) -> ClusterConfig:
    """Meta's H100 SXM 80GB (700 W) RoCE cluster: NVLink 4 (450 GB/s per direction), 400 Gb/s per GPU
    = 50 GB/s (Dubey et al. 2024, section 3.3.1)."""
    return ClusterConfig(name="grand-teton", nodes=nodes, gpus_per_node=8, gpu="h100_sxm", gpu_memory_gb=80,
                         nvlink_bandwidth_gbs=450, ib_bandwidth_gbs=50)


def dgx_h100(nodes: int) -> ClusterConfig:
    """NVIDIA DGX H100 (SXM 80GB): NVLink 4 (450 GB/s per direction per GPU), 8 x ConnectX-7 NDR 400 Gb/s per
    node = 50 GB/s per GPU (DGX H100 user guide). The machine of Megatron-Core's published scaling runs."""
    return ClusterConfig(name="dgx-h100", nodes=nodes, gpus_per_node=8, gpu="h100_sxm", gpu_memory_gb=80,
                         nvlink_bandwidth_gbs=450, ib_bandwidth_gbs=50)


def grand_teton_500w(nodes: int) -> ClusterConfig:
    """torchtitan's benchmark hosts: H100 with 96 GB HBM2e at 500 W, 400 Gb/s per GPU (docs/performance.md)."""
    return ClusterConfig(name="grand-teton-96g", nodes=nodes, gpus_per_node=8, gpu="h100_sxm", gpu_memory_gb=96,
                         nvlink_bandwidth_gbs=450, ib_bandwidth_gbs=50)


# --- model shapes -------------------------------------------------------------------------------------------

def gpt2021(layers: int, hidden: int, heads: int, vocab: int = 51200, seq: int = 2048) -> ModelConfig:
    """GPT-3-style model of the 2021-22 Megatron papers: GeLU MLP (f = 4h), LayerNorm, learned absolute
    positions, tied embeddings, biases."""
    return ModelConfig(name=f"gpt-{layers}x{hidden}", num_layers=layers, hidden_size=hidden,
                       ffn_hidden_size=4 * hidden, num_attention_heads=heads, seq_length=seq, vocab_size=vocab,
                       swiglu=False, position_embedding_type="learned_absolute", normalization="LayerNorm",
                       untie_embeddings_and_output_weights=False, add_bias_linear=True, attention_backend="unfused")


def llama3(size: str, seq: int = 8192) -> ModelConfig:
    """Llama 3 / 3.1 (Dubey et al. 2024, Table 3): SwiGLU, RMSNorm, RoPE, GQA 8, untied, vocab 128,256."""
    h, layers, f, heads = {"8b": (4096, 32, 14336, 32), "70b": (8192, 80, 28672, 64),
                           "405b": (16384, 126, 53248, 128)}[size]
    return ModelConfig(name=f"llama3-{size}", num_layers=layers, hidden_size=h, ffn_hidden_size=f,
                       num_attention_heads=heads, num_query_groups=8, seq_length=seq, vocab_size=128256)


def _job(model: ModelConfig, cluster: ClusterConfig, gbs: int, mbs: int = 1, precision: str = "bf16",
         **par) -> Job:
    return Job(model=model, cluster=cluster, parallelism=ParallelismConfig(**par),
               training=TrainingConfig(global_batch_size=gbs, micro_batch_size=mbs, precision=precision),
               data=DataConfig())


# --- 1. Narayanan et al. 2021 (arXiv:2104.04473), Table 1 ---------------------------------------------------
# The authors' script for Table 1, NVIDIA/Megatron-LM examples/sc21/run_table_1.sh (commit 6985e58938,
# 2021-08-18; examples/sc21/README.md: "scripts that were used to produce the results in the Megatron paper"),
# gives per row the micro-batch (MBS), the layers per virtual pipeline stage (--num-layers-per-virtual-pipeline-
# stage: 76B 5, 145B 5, 310B 3, 530B 1; the others not interleaved) and the DDP: torch for the pp=1 rows (its
# all-reduce overlaps the last microbatch's backward, model.no_sync() around the others in megatron/schedules.py),
# local for pp > 1 (all-reduce after the backward). CONFIG.sh: fp16, sequence 2048; uniform full recompute of
# every layer. The scatter/gather of pipeline sends is on by default in that code (megatron/arguments.py:
# --no-scatter-gather-tensors-in-pipeline). Engine "megatron-lm-2021": no distributed optimizer, unfused
# attention, fp16 gradients all-reduced in fp16, activations scattered over tp between stages.
# Torch DDP's bucket: bucket_cap_mb 25 = 12.5M fp16 gradients.
NARAYANAN_TABLE_1 = [  # size B, heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s per GPU, MBS, layers/virtual, DDP
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 16, None, "torch"),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 16, None, "torch"),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 16, None, "torch"),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 8, None, "torch"),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 4, None, "local"),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 5, "local"),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 5, "local"),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 3, "local"),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 1, "local"),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, None, "local"),
]
TORCH_DDP_BUCKET = 25 * 2**20 // 2  # torch.nn.parallel.DistributedDataParallel bucket_cap_mb=25, fp16 gradients


def narayanan() -> list[Published]:
    out = []
    for size, heads, hidden, layers, tp, pp, gpus, batch, tflops, mbs, per_virtual, ddp in NARAYANAN_TABLE_1:
        job = _job(gpt2021(layers, hidden, heads), selene(gpus // 8), batch, mbs, precision="fp16", tp=tp, pp=pp,
                   vpp=layers // pp // per_virtual if per_virtual else None, recompute="full",
                   distributed_optimizer=False, overlap_grad_reduce=ddp == "torch",
                   bucket_size=TORCH_DDP_BUCKET if ddp == "torch" else None)
        out.append(Published("Narayanan 2021", "Narayanan et al. 2021, arXiv:2104.04473, Table 1; layout flags: "
                             "NVIDIA/Megatron-LM examples/sc21/run_table_1.sh at 6985e58938",
                             f"{size:g}B tp{tp} pp{pp} {gpus} GPUs", size, job, "tflops", tflops, flops="paper",
                             engine="megatron-lm-2021"))
    return out


# --- 2. Korthikanti et al. 2022 (arXiv:2205.05198), Tables 3 and 5 ------------------------------------------
# Sequence parallelism + selective recompute ("present work" row of Table 5: iteration time in seconds).
# Layouts from Table 3: 22B tp8 (8 GPUs, batch 4), 175B tp8 pp8 (64, 64), 530B tp8 pp35 (280, 280),
# 1T tp8 pp64 (512, 512); sequence 2048, vocabulary 51,200, fp16 on Selene.
KORTHIKANTI = [  # size B, heads, hidden, layers, tp, pp, GPUs, batch, micro-batch, seconds per iteration
    (22, 64, 6144, 48, 8, 1, 8, 4, 4, 1.10),
    (175, 96, 12288, 96, 8, 8, 64, 64, 1, 13.75),
    (530, 128, 20480, 105, 8, 35, 280, 280, 1, 37.83),
    (1000, 160, 25600, 128, 8, 64, 512, 512, 1, 71.49),
]


def korthikanti() -> list[Published]:
    out = []
    for size, heads, hidden, layers, tp, pp, gpus, batch, mbs, step in KORTHIKANTI:
        job = _job(gpt2021(layers, hidden, heads), selene(gpus // 8), batch, mbs, precision="fp16", tp=tp, pp=pp,
                   sequence_parallel=True, recompute="selective", distributed_optimizer=False)
        out.append(Published("Korthikanti 2022", "Korthikanti et al. 2022, arXiv:2205.05198, Tables 3 and 5",
                             f"{size:g}B tp{tp} pp{pp} sp sel {gpus} GPUs", size, job, "step_s", step))
    return out


# --- 3. Smith et al. 2022, MT-NLG 530B (arXiv:2201.11990), section 2.4 --------------------------------------
# 105 layers, h 20480, 128 heads, sequence 2048, GPT-2 vocabulary; 8-way tensor x 35-way pipeline, global batch
# 1920, on 280 / 350 / 420 DGX A100 nodes: 60.1 / 50.2 / 44.4 s per iteration (126 / 121 / 113 TFLOP/s per GPU).
MT_NLG = [(280, 60.1), (350, 50.2), (420, 44.4)]


def mt_nlg() -> list[Published]:
    out = []
    for nodes, step in MT_NLG:
        job = _job(gpt2021(105, 20480, 128, vocab=50257), selene(nodes), 1920, precision="bf16", tp=8, pp=35,
                   recompute="full", distributed_optimizer=True)
        out.append(Published("Smith 2022 (MT-NLG)", "Smith et al. 2022, arXiv:2201.11990, section 2.4",
                             f"530B tp8 pp35 {nodes * 8} GPUs", 530, job, "step_s", step,
                             assumed="micro-batch 1, full recompute, ZeRO-1 (DeepSpeed) as the optimizer shard",
                             engine="deepspeed"))
    return out


# --- 4. Dubey et al. 2024, Llama 3 (arXiv:2407.21783), Table 4 ----------------------------------------------
# 405B, 16M tokens per step; (GPUs, tp, cp, pp, dp, sequence, batch per dp) -> TFLOP/s per GPU (BF16 MFU 43/41/38%).
LLAMA3_TABLE_4 = [
    (8192, 8, 1, 16, 64, 8192, 32, 430),
    (16384, 8, 1, 16, 128, 8192, 16, 400),
    (16384, 8, 16, 16, 8, 131072, 16, 380),
]


def llama3_405b() -> list[Published]:
    out = []
    for gpus, tp, cp, pp, dp, seq, per_dp, tflops in LLAMA3_TABLE_4:
        job = _job(llama3("405b", seq), grand_teton(gpus // 8), per_dp * dp, tp=tp, cp=cp, pp=pp, vpp=4,
                   sequence_parallel=True, recompute="none", distributed_optimizer=True,
                   account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
        out.append(Published("Dubey 2024 (Llama 3)", "Dubey et al. 2024, arXiv:2407.21783, Table 4",
                             f"405B tp{tp} cp{cp} pp{pp} dp{dp} seq {seq}", 405, job, "tflops", tflops,
                             assumed="interleaved schedule with 4 chunks per stage, one layer fewer on the first "
                                     "and last stage (section 3.3.2), no recompute, micro-batch 1"))
    return out


# --- 5. BLOOM 176B (BigScience 2022; Le Scao et al., arXiv:2211.05100) ---------------------------------------
# 70 layers, h 14336, 112 heads, sequence 2048, vocabulary 250,680; 384 A100 80GB, tp4 pp12 dp8, micro-batch 2,
# global batch 2048, bf16, ZeRO-1, full recompute; "training throughput: about 150 TFLOPs" and "one copy of the
# model takes 48 GPUs (using 60 GB of memory on each GPU)" (BigScience 176B model page; paper section 3.4).
def bloom() -> list[Published]:
    model = ModelConfig(name="bloom-176b", num_layers=70, hidden_size=14336, ffn_hidden_size=4 * 14336,
                        num_attention_heads=112, seq_length=2048, vocab_size=250680, swiglu=False,
                        position_embedding_type="rope", normalization="LayerNorm",
                        untie_embeddings_and_output_weights=False, add_bias_linear=True,
                        attention_backend="unfused")
    job = _job(model, jean_zay(48), 2048, 2, tp=4, pp=12, recompute="full", distributed_optimizer=True,
               account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    cite = "BigScience 2022, BLOOM 176B model page and arXiv:2211.05100 section 3.4"
    assumed = "embedding and loss count as pipeline layers (DeepSpeed's partition, 70 + 2 = 72 = 12 x 6)"
    return [Published("BigScience 2022 (BLOOM)", cite, "176B tp4 pp12 dp8 mbs2", 176, job, "tflops", 150,
                      flops="paper", assumed=assumed, engine="deepspeed"),
            Published("BigScience 2022 (BLOOM)", cite, "176B tp4 pp12 dp8 mbs2 memory", 176, job, "memory_gib",
                      60 * 1e9 / 2**30, assumed=assumed + "; '60 GB' read as 10^9 bytes",
                      framework="deepspeed-bf16")]


# --- 6. torchtitan (PyTorch), docs/performance.md, Tables 1 and 3: measured memory with FSDP ------------------
# Llama 3.1 8B, sequence 8192, local batch 2, selective activation checkpointing, FSDP (parameters, gradients and
# optimizer state sharded over all GPUs), no torch.compile, no Float8 (the plain "FSDP" rows).
def torchtitan() -> list[Published]:
    out = []
    for table, gpus, mem in (("Table 1", 8, 82.4), ("Table 3", 128, 67.0)):
        job = _job(llama3("8b"), grand_teton_500w(gpus // 8), 2 * gpus, 2, recompute="selective",
                   distributed_optimizer=True, sharding="full")
        out.append(Published("torchtitan (FSDP)", f"pytorch/torchtitan docs/performance.md, {table}",
                             f"8B FSDP{gpus} mbs2 memory", 8, job, "memory_gib", mem,
                             assumed="selective_ac_option 'op' (the 8B preset's), FSDP2 with fp32 sharded "
                                     "parameters", framework="torchtitan"))
    return out



# --- 7. Megatron-LM pull request #482 (review of 2023-12-12): a measured peak beside an estimate ---------------
# Llama 2 7B, bf16, micro-batch 2, global batch 2048, 2 nodes x 8 A100 SXM, dp 8, pp 2, tp 1: peak memory 69.1 on
# rank 0 (the table's "Peak_Memory_Actual").
def megatron_pr482() -> list[Published]:
    model = ModelConfig(name="llama2-7b", num_layers=32, hidden_size=4096, ffn_hidden_size=11008,
                        num_attention_heads=32, seq_length=4096, vocab_size=32000)
    job = _job(model, selene(2), 2048, 2, tp=1, pp=2, distributed_optimizer=True)
    return [Published("Megatron-LM PR 482", "NVIDIA/Megatron-LM pull request #482, review 2023-12-12, table",
                      "7B tp1 pp2 dp8 mbs2 memory", 7, job, "memory_gib", 69.1,
                      assumed="sequence 4096 (Llama 2), flash attention, distributed optimizer, no recompute, "
                              "the 69.1 read as GiB (torch's allocator report)")]


# --- 8. Megatron-Core r0.8.0 scaling results on H100 (NVIDIA/Megatron-LM README.md) -------------------------
# README.md "Performance Benchmarking" (since commit f2e5db402c, 2024-07-15, "New scaling figures on H100 GPUs"):
# images/model_table.png (weak scaling: model, heads, hidden, layers, tp, pp, dp, GPUs, batch, TFLOP/s per GPU,
# MFU) and the strong-scaling text: "the standard GPT-3 model (slightly more than 175 billion parameters due to
# larger vocabulary size) from 96 H100 GPUs to 4608 GPUs, using the same batch size of 1152 sequences throughout
# ... a reduction in MFU from 47% to 42%". Vocabulary 131,072, sequence 4096, bf16; "fine-grained overlapping
# with DP (--overlap-grad-reduce, --overlap-param-gather), TP (--tp-comm-overlap), and PP". The parameter counts
# of the table (1.7B at h 2048 x 24 layers ...) are those of a GPT-3 MLP (4h, GeLU) with untied embeddings.
MCORE_WEAK = [  # size B, heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s per GPU
    (1.7, 16, 2048, 24, 1, 1, 48, 192, 408.8),
    (7.1, 32, 4096, 30, 2, 1, 96, 192, 465.9),
    (16, 48, 6144, 32, 4, 1, 192, 192, 489.1),
    (32, 56, 7168, 48, 8, 1, 384, 192, 459.6),
    (70, 64, 8192, 84, 8, 2, 768, 384, 419.7),
    (119, 80, 10240, 92, 8, 4, 1536, 768, 420.5),
    (177, 96, 12288, 96, 8, 6, 2304, 1152, 432.8),
    (314, 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
    (462, 144, 18432, 112, 8, 16, 6144, 3072, 459.9),
]
# Strong scaling of the 177B model at batch 1152: the end points the text states (96 and 4608 GPUs, MFU 47% and
# 42%); the 2304-GPU point of the figure is the weak-scaling table's 177B row. Layout: the table's tp8 pp6.
MCORE_STRONG = [(96, 0.47), (4608, 0.42)]
MCORE_ASSUMED = ("micro-batch 1, no recompute, fused attention, sequence parallel with tp, distributed optimizer, "
                 "dp reduce and gather overlapped; with pp > 1 the interleaved schedule (Megatron overlaps PP "
                 "communication only there) with one layer per chunk (the chunk count is not published); the TP "
                 "overlap is not credited (the planner counts the TP collectives exposed)")


def mcore_gpt(layers: int, hidden: int, heads: int) -> ModelConfig:
    return ModelConfig(name=f"mcore-gpt-{layers}x{hidden}", num_layers=layers, hidden_size=hidden,
                       ffn_hidden_size=4 * hidden, num_attention_heads=heads, seq_length=4096, vocab_size=131072,
                       swiglu=False, position_embedding_type="learned_absolute", normalization="LayerNorm",
                       untie_embeddings_and_output_weights=True, add_bias_linear=True)


def _mcore_job(layers: int, hidden: int, heads: int, tp: int, pp: int, gpus: int, batch: int) -> Job:
    return _job(mcore_gpt(layers, hidden, heads), dgx_h100(gpus // 8), batch, tp=tp, pp=pp,
                vpp=layers // pp if pp > 1 else None, sequence_parallel=tp > 1, recompute="none",
                distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, tp_comm_overlap=tp > 1)


def megatron_core_h100() -> list[Published]:
    cite = "NVIDIA/Megatron-LM README.md (Megatron-Core r0.8.0 on H100, commit f2e5db402c), "
    out = []
    for size, heads, hidden, layers, tp, pp, gpus, batch, tflops in MCORE_WEAK:
        out.append(Published("Megatron-Core r0.8 (H100)", cite + "weak-scaling table",
                             f"{size:g}B tp{tp} pp{pp} {gpus} GPUs", size,
                             _mcore_job(layers, hidden, heads, tp, pp, gpus, batch), "tflops", tflops,
                             flops="model_full_square", assumed=MCORE_ASSUMED))
    peak = peak_flops("h100_sxm", "bf16") / 1e12
    for gpus, mfu in MCORE_STRONG:
        out.append(Published("Megatron-Core r0.8 (H100)", cite + "strong-scaling text",
                             f"177B tp8 pp6 {gpus} GPUs batch 1152 (strong)", 177,
                             _mcore_job(96, 12288, 96, 8, 6, gpus, 1152), "tflops", mfu * peak,
                             flops="model_full_square", assumed=MCORE_ASSUMED + "; MFU x 989 TFLOP/s"))
    return out


# --- 9. Megatron-LM's own CI on DGX H100: a sub-1B model (no accuracy target below 1B; reported) -------------
# tests/functional_tests/test_cases/gpt/gpt3_345m_nightly_dgx_a100_1N8G_mcore_<layout>/: model_config.yaml (12
# layers, hidden 512, 8 heads, sequence 1024, GPT-2 BPE vocabulary, micro-batch 4, global batch 32, 8 GPUs,
# --transformer-impl local, --deterministic-mode, NCCL_ALGO=Ring, --timing-log-level 2) and
# golden_values_dev_dgx_h100.json ("iteration-time" per step; the median of the steps after the first).
# --timing-log-level 2 turns on the per-microbatch 'forward-compute'/'backward-compute' timers, whose start and
# stop call torch.cuda.synchronize() (megatron/core/timers.py): the host cannot run ahead of the GPU across them.
# That costs about one kernel's latency per timer; the step is host-bound either way (see the test's xfail).
MEGATRON_CI = [  # layout dir, tp, pp, precision, median iteration time s (steps), golden-values commit
    ("tp1_pp4", 1, 4, "bf16", 0.12298, "steps 2-50", "062fa08e8b"),
    ("tp4_pp1_resume_torch_dist", 4, 1, "fp16", 0.19585, "steps 5-100 every 5th", "737e71fc40"),
]


def megatron_ci_h100() -> list[Published]:
    out = []
    for case, tp, pp, precision, step, steps, commit in MEGATRON_CI:
        model = gpt2021(12, 512, 8, vocab=50257, seq=1024)
        job = _job(model, dgx_h100(1), 32, 4, precision=precision, tp=tp, pp=pp, distributed_optimizer=False)
        size = shape_of(model, tp).total_params / 1e9
        out.append(Published("Megatron-LM CI (sub-1B, H100)",
                             f"NVIDIA/Megatron-LM tests/functional_tests/test_cases/gpt/gpt3_345m_nightly_dgx_a100_"
                             f"1N8G_mcore_{case}, golden_values_dev_dgx_h100.json at {commit}, {steps}",
                             f"{1e3 * size:.0f}M tp{tp} pp{pp} 8 GPUs mbs4", size, job, "step_s", step,
                             assumed="unfused attention (local transformer implementation), no distributed "
                                     "optimizer; the synchronizing timers are not modelled"))
    return out


def all_rows() -> list[Published]:
    return (narayanan() + korthikanti() + mt_nlg() + llama3_405b() + bloom() + torchtitan() + megatron_pr482()
            + megatron_core_h100() + megatron_ci_h100())


def summary(rows: list[Published] | None = None, min_params_b: float = 1.0) -> dict[tuple[str, str], dict]:
    """Per (source, "speed" | "memory"): rows, median and worst |error|, over models >= ``min_params_b``."""
    out: dict[tuple[str, str], dict] = {}
    for r in rows if rows is not None else all_rows():
        if r.params_b < min_params_b:
            continue
        kind = "memory" if r.metric == "memory_gib" else "speed"
        out.setdefault((r.source, kind), {"errors": [], "cite": r.cite})["errors"].append(r.error())
    for entry in out.values():
        errs = sorted(abs(e) for e in entry["errors"])
        n = len(errs)
        entry["n"] = n
        entry["median"] = errs[n // 2] if n % 2 else (errs[n // 2 - 1] + errs[n // 2]) / 2
        entry["worst"] = errs[-1]
    return out
