"""The job schema: typed dataclasses registered in Hydra's ConfigStore.

The YAML files in ``hydra_conf/`` only *select and override*; every field, its type and its
default live here, so a typo fails at compose time with Hydra's "Did you mean ..." and a
wrong type fails before anything is checked or rendered.

Field names follow Megatron-LM's argument names for the model (``num_layers``,
``hidden_size``, ...) so users can paste values from Megatron recipes. Parallelism uses
short names (``tp``, ``pp``, ...). ``dp`` is never configured: it is derived from the world
size (see :func:`Job.dp`). Every derived value (``dp``, microbatches per step, the run's
iterations, the padded vocabulary, the layout label, the periodic checkpoint interval) is a
property here, computed in one place for the check, the planner, the renderer and the ranks.

This module must stay importable on a login node: no torch, no megatron.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Dict, List, Literal, Optional, Union, get_args, get_origin, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from launch import vocab
from launch.nan_guard_config import NanGuardConfig, OnNan  # noqa: F401  (OnNan: a choice type)
from launch.local_ckpt_config import LocalCheckpointConfig
from launch.paths import RunPaths
from launch.planner_config import PlannerCalibration
from launch.stragglers_config import StragglersConfig
from launch.watchdog_config import WatchdogConfig

# ---- choices, each listed once --------------------------------------------------------------
# A choice field is ``Annotated[str, Literal[...]]``: OmegaConf has no Literal type and stores a str
# (so a wrong value composes and reaches the check instead of stopping composition with a traceback
# at the first one); launch/check.py reads the allowed values from the annotation (:data:`CHOICES`)
# and reports every wrong one in its problem list, each with the allowed values and a did-you-mean.
Recompute = Annotated[str, Literal["none", "selective", "full"]]
Precision = Annotated[str, Literal["bf16", "fp16", "fp32", "fp8"]]
LrDecayStyle = Annotated[str, Literal["cosine", "linear", "constant"]]
Launcher = Annotated[str, Literal["slurm", "local"]]
DataKind = Annotated[str, Literal["mock", "indexed"]]
PositionEmbedding = Annotated[str, Literal["rope", "learned_absolute"]]
Normalization = Annotated[str, Literal["RMSNorm", "LayerNorm"]]
PlanFormat = Annotated[str, Literal["table", "json"]]
OnReplayMismatch = Annotated[str, Literal["auto", "warn", "stop", "rollback"]]
OnSaveFailure = Annotated[str, Literal["stop", "retry", "skip"]]
WandbMode = Annotated[str, Literal["offline", "online"]]
# ``training.checkpoint_interval``: a positive step count or 'auto'. OmegaConf sees Any (its Union[int, str]
# refuses 1.5 or true at composition, first error only); the check reports a wrong value in its list.
CheckpointInterval = Annotated[Any, Union[int, Literal["auto"]]]


def allowed_values(annotation: Any) -> Optional[tuple]:
    """The values a choice annotation (``Annotated[str, Literal[...]]``) allows; None for any other type."""
    if get_origin(annotation) is Annotated:
        for meta in annotation.__metadata__:
            if get_origin(meta) is Literal:
                return get_args(meta)
    return None


class AttentionBackend(str, Enum):
    """Attention kernels: ``fused`` (flash / cuDNN fused attention, TransformerEngine's default on GPUs)
    never writes the s x s scores to memory; ``unfused`` (Megatron's local spec, the 2021-22 papers)
    does. A string enum: Hydra refuses any other value at compose time."""

    fused = "fused"
    unfused = "unfused"


class Sharding(str, Enum):
    """What the data-parallel group shards. ``optimizer``: the fp32 main weights and Adam moments
    (ZeRO-1, with ``distributed_optimizer``); ``full``: weights and gradients too (ZeRO-3 / FSDP)."""

    optimizer = "optimizer"
    full = "full"


@dataclass
class ModelConfig:
    """A GPT decoder; names are Megatron-LM's ``--arg`` names."""

    name: str = MISSING  # label used in run names and reports
    num_layers: int = MISSING  # transformer layers
    hidden_size: int = MISSING  # model width h
    ffn_hidden_size: int = MISSING  # MLP inner width (per expert for MoE)
    num_attention_heads: int = MISSING  # query heads
    num_query_groups: Optional[int] = None  # KV heads for GQA; None means = num_attention_heads (MHA)
    kv_channels: Optional[int] = None  # per-head dim; None means hidden_size // num_attention_heads
    seq_length: int = MISSING  # training sequence length
    max_position_embeddings: Optional[int] = None  # None means = seq_length
    vocab_size: int = MISSING  # tokenizer vocabulary before padding
    make_vocab_size_divisible_by: int = 128  # padded vocab is a multiple of this * tp (Megatron)
    swiglu: bool = True  # gated SiLU MLP (3 matrices) instead of GeLU (2 matrices)
    position_embedding_type: PositionEmbedding = "rope"  # rope | learned_absolute
    rotary_base: int = 10000  # RoPE theta
    normalization: Normalization = "RMSNorm"  # RMSNorm | LayerNorm
    untie_embeddings_and_output_weights: bool = True  # separate output layer (Llama) or tied (GPT-3)
    add_bias_linear: bool = False  # biases in linear layers (GPT-3 style)
    num_experts: Optional[int] = None  # MoE experts per layer; None means dense
    moe_router_topk: int = 2  # experts each token is routed to
    moe_ffn_hidden_size: Optional[int] = None  # expert MLP width; None means = ffn_hidden_size
    attention_backend: AttentionBackend = AttentionBackend.fused  # fused | unfused (see AttentionBackend)


@dataclass
class ParallelismConfig:
    """The device mesh. ``dp = world / (tp * pp * cp)`` is derived, never set."""

    name: str = "custom"  # label for reports and sweep registries
    tp: int = 1  # tensor-parallel size (inside one NVLink domain)
    pp: int = 1  # pipeline-parallel stages
    vpp: Optional[int] = None  # virtual pipeline chunks per stage (interleaved 1F1B); needs pp > 1
    cp: int = 1  # context-parallel size (needs TransformerEngine; GPU only)
    ep: int = 1  # expert-parallel size (MoE only)
    sequence_parallel: bool = False  # shard LayerNorm/dropout activations across tp; needs tp > 1
    distributed_optimizer: bool = True  # shard fp32 main params and Adam moments across dp (ZeRO-1)
    recompute: Recompute = "none"  # none | selective | full activation recomputation
    sharding: Sharding = Sharding.optimizer  # optimizer (ZeRO-1) | full (ZeRO-3/FSDP: weights + grads too)
    overlap_grad_reduce: bool = False  # overlap the dp gradient reduce with the backward pass (bucketed)
    overlap_param_gather: bool = False  # overlap the dp weight all-gather with the next forward; needs distributed_optimizer
    bucket_size: Optional[int] = None  # parameters per gradient bucket with overlap; None = Megatron's max(40M, 1M * dp)
    tp_comm_overlap: bool = False  # overlap TP all-gather/reduce-scatter with GEMMs (TransformerEngine; tp > 1 with sp)
    allow_tp_across_nodes: bool = False  # permit tp > gpus_per_node (slow: TP traffic on IB)
    account_for_embedding_in_pipeline_split: bool = False  # count the embedding as a layer of stage 0
    account_for_loss_in_pipeline_split: bool = False  # count the output layer + loss as a layer of the last stage

    @property
    def label(self) -> str:
        """Short label of a layout: ``tp8-pp8-vpp2-sp-sel`` (cp, ep, full, no-dopt when they apply)."""
        parts = [f"tp{self.tp}", f"pp{self.pp}"]
        if self.vpp and self.pp > 1:
            parts.append(f"vpp{self.vpp}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.recompute == "selective":
            parts.append("sel")
        elif self.recompute == "full":
            parts.append("full")
        if not self.distributed_optimizer:
            parts.append("nodo")
        return "-".join(parts)


@dataclass
class ContainerConfig:
    """pyxis/enroot container settings (empty image means no container)."""

    image: str = ""  # e.g. nvcr.io#nvidia/pytorch:24.08-py3 or a .sqsh path
    mounts: List[str] = field(default_factory=list)  # src:dst pairs for --container-mounts
    workdir: str = ""  # --container-workdir


@dataclass
class ClusterConfig:
    """One site. Adding a cluster is a YAML file under hydra_conf/cluster/, never code."""

    name: str = MISSING  # label
    launcher: Launcher = "slurm"  # slurm | local (N processes on this machine, no Slurm)
    partition: str = ""  # --partition ('' = site default)
    account: str = ""  # --account
    qos: str = ""  # --qos
    nodes: int = 1  # nodes requested
    gpus_per_node: int = 8  # GPUs (= tasks = ranks) per node used by the job
    cpus_per_node: int = 8  # CPUs per node; cpus_per_task = cpus_per_node // gpus_per_node
    mem_per_node_gb: int = 0  # --mem in GB (0 = Slurm default / whole node)
    gpu: str = "h100_sxm"  # key into analysis.flops peak table; 'cpu' means no accelerator (no MFU)
    gpu_memory_gb: float = 80.0  # usable memory per GPU for the planner's fit check
    max_time_min: int = 2880  # partition's maximum wall time
    nvlink_bandwidth_gbs: float = 450.0  # per-GPU unidirectional NVLink bandwidth, GB/s
    ib_bandwidth_gbs: float = 50.0  # per-GPU inter-node bandwidth, GB/s (NDR 400 Gb/s = 50 GB/s)
    fs_write_bandwidth_gbs: float = 20.0  # aggregate checkpoint write bandwidth, GB/s
    node_mtbf_hours: float = 50000.0  # mean time between failures of one node (Young/Daly, simulation)
    requeue_allowed: bool = True  # site permits `scontrol requeue` / --requeue
    gpu_hour_price: Optional[float] = None  # price of one GPU-hour (site's currency); None = no cost line
    quota_file: str = ""  # the site's per-account GPU-hour quotas (launch/ledger.py); '' = none
    run_root: str = "runs"  # where runs/<name>/ live (shared filesystem on a real cluster)
    data_root: str = ""  # dataset prefix root
    checkpoint_root: str = ""  # '' = <run_dir>/checkpoints
    local_checkpoint_dir: str = ""  # node-local path (/dev/shm/..., local NVMe) of training.local_checkpoint: one
    # directory per node, <local_checkpoint_dir>/<node name>/<run.name>/ ('' = no local tier)
    local_write_bandwidth_gbs: float = 5.0  # write bandwidth of local_checkpoint_dir per node, GB/s (the planner's
    # local save time; a local NVMe ~2-7, /dev/shm ~10 or more)
    lustre_stripe_count: int = 0  # >0: `lfs setstripe -c N` on the checkpoint dir
    lustre_stripe_size: str = "4M"  # `lfs setstripe -S`
    python: str = "python3"  # interpreter on the compute nodes, after modules/setup
    modules: List[str] = field(default_factory=list)  # `module load` lines
    setup: List[str] = field(default_factory=list)  # extra shell lines before srun (venv activation ...)
    env: Dict[str, str] = field(default_factory=dict)  # exported before srun (NCCL_*, UCX_*, ...)
    container: ContainerConfig = field(default_factory=ContainerConfig)
    sbatch_extra: Dict[str, str] = field(default_factory=dict)  # additional #SBATCH --key=value
    exclude: str = ""  # nodes to keep out (--exclude)
    # in-job restart (recovery/injob.py): ask for nodes + spare_nodes with --no-kill; after a crash, hang or lost
    # node the batch script starts a new srun step on `nodes` healthy nodes of the same allocation
    spare_nodes: int = 0  # hot spares in the allocation (0 = every failure goes through the requeue path)
    in_job_restarts: int = 3  # relaunches inside one allocation before falling back to the requeue
    planner: PlannerCalibration = field(default_factory=PlannerCalibration)  # the step-time model's constants


@dataclass
class ReplayConfig:
    """Replay parity (recovery/replay.py): after a resume, the first replayed steps are compared with the loss and
    grad norm the lost attempt logged for them."""

    check_steps: int = 4  # replayed steps compared (0 = off)
    on_mismatch: OnReplayMismatch = "auto"  # auto (stop when bitwise was expected, else warn) | warn | stop |
    # rollback (quarantine the checkpoint, load the previous verified one, replay again)
    rtol: float = 1.0e-3  # relative tolerance when the layout, world size or precision differs from the logging attempt


@dataclass
class TrainingConfig:
    """Optimisation and the run's lifecycle (checkpoints, signals, restarts)."""

    global_batch_size: int = 8  # sequences per optimizer step, over all dp ranks
    micro_batch_size: int = 1  # sequences per forward pass per rank
    train_iters: Optional[int] = 20  # optimizer steps; or derive from train_tokens
    train_tokens: Optional[int] = None  # if set, train_iters = ceil(tokens / (gbs * seq))
    lr: float = 3.0e-4  # peak learning rate
    min_lr: float = 3.0e-5  # floor of the decay
    lr_warmup_iters: int = 2  # linear warm-up steps
    lr_decay_style: LrDecayStyle = "cosine"  # cosine | linear | constant
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    clip_grad: float = 1.0  # global grad-norm clip
    precision: Precision = "bf16"  # bf16 | fp16 (dynamic loss scaling) | fp32 | fp8 (needs TransformerEngine on the ranks)
    initial_loss_scale: float = 4294967296.0  # fp16: the dynamic loss scale's start (Megatron-LM's 2**32)
    loss_scale_window: int = 1000  # fp16: clean steps before the scale doubles
    hysteresis: int = 2  # fp16: overflowing steps tolerated before the scale halves
    seed: int = 1234
    log_interval: int = 1  # iterations between log lines
    eval_interval: int = 0  # iterations between validation-loss evaluations (0 = none); also at the last step
    eval_iters: int = 2  # global batches of the validation split per evaluation (the same batches every time)
    checkpoint_interval: CheckpointInterval = 10  # steps between periodic saves, or 'auto' (Young/Daly)
    keep_checkpoints: int = 3  # newest K verified checkpoints kept
    async_save: bool = True  # periodic saves write in the background (Megatron-Core's async path); stops save sync
    on_save_failure: OnSaveFailure = "stop"  # periodic saves only (a stop or final save always stops): stop |
    # retry (once, at the next interval) | skip (a WARNING, up to max_skipped_saves failures in a row)
    max_skipped_saves: int = 3  # on_save_failure=skip: consecutive failed periodic saves before the run stops
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    signal_lead_time_s: int = 120  # --signal lead: warning this long before the time limit
    max_restarts: int = 20  # unplanned restarts (crashes, hangs, node failures); planned requeues not counted
    zero_progress_restarts: int = 3  # stop after N consecutive restarts with no new checkpoint
    requeue_on_crash: bool = True  # Slurm: requeue a crashed attempt (bounded by the two limits above)
    restart_from_scratch: bool = False  # fresh submission only: move existing checkpoints to quarantine/, start at 0
    init_from: str = ""  # hf:DIR: step 0 starts from these Hugging Face weights (a resume always loads the run's own)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)  # hang watchdog (recovery/watchdog.py)
    nan_guard: NanGuardConfig = field(default_factory=NanGuardConfig)  # NaN/Inf guard (train/nan_guard.py)
    stragglers: StragglersConfig = field(default_factory=StragglersConfig)  # live stragglers (train/stragglers.py)
    local_checkpoint: LocalCheckpointConfig = field(default_factory=LocalCheckpointConfig)  # node-local tier
    # memory health (train/memory.py)
    memory_window: int = 5  # log intervals over which a growing reserved-allocated gap or alloc retries is an event
    oom_snapshot: bool = False  # GPU: record the allocator's history; a CUDA OOM dumps the snapshot under oom/

    @property
    def checkpoint_interval_is_auto(self) -> bool:
        """``checkpoint_interval='auto'`` (any case, spaces ignored): Young/Daly after a measured step and save."""
        ci = self.checkpoint_interval
        return isinstance(ci, str) and ci.strip().lower() == "auto"

    @property
    def fixed_checkpoint_interval(self) -> Optional[int]:
        """The configured steps between periodic saves; None for 'auto' or an invalid value (the check refuses it)."""
        ci = self.checkpoint_interval
        return ci if isinstance(ci, int) and not isinstance(ci, bool) and ci > 0 else None


@dataclass
class DataConfig:
    """Where tokens come from."""

    kind: DataKind = "mock"  # mock (deterministic synthetic) | indexed (Megatron .bin/.idx)
    path: str = ""  # indexed dataset prefix (without .bin/.idx); or data.blend
    blend: Any = None  # weighted prefixes: [{path: data/web, weight: 0.3}, ...] or '0.3 data/web 0.7 data/code'
    valid_blend: Any = None  # validation from other prefixes (same forms); data.split then does not apply
    tokenizer: str = "byte"  # byte (offline, 256 bytes + EOD)
    split: str = "99,1,0"  # train,valid,test weights
    seed: int = 1234


@dataclass
class RunConfig:
    """One named run: its directory holds config, script, job ids, logs and checkpoints."""

    name: str = "${model.name}"  # runs/<name>/; the same name continues the same run (default: the model's name)
    dir: str = ""  # '' = <cluster.run_root>/<name>
    time_limit_min: int = 60  # --time for each job (slice) of the run
    dependency_chain: int = 0  # >0: pre-submit N afterany continuations (sites without requeue)
    budget_gpu_hours: Optional[float] = None  # GPU-hours (process-hours on cpu): refuse an estimate over it; the ranks stop at it
    sweep_budget_gpu_hours: Optional[float] = None  # -m: members past it (by their estimates, in order) are refused


@dataclass
class TrackingConfig:
    """Scalars for TensorBoard / W&B (train/tracking.py); both packages are the optional extra [tracking]."""

    tensorboard: bool = True  # <run_dir>/tensorboard/, Megatron-LM's scalar names
    wandb: bool = False  # one W&B run per slurmtron run, resumed by every attempt
    wandb_mode: WandbMode = "offline"  # offline (sync later: clusters often have no internet) | online
    wandb_project: str = "slurmtron"
    wandb_entity: str = ""  # '' = the W&B default entity


@dataclass
class PlanConfig:
    """Options of launch/plan.py."""

    format: PlanFormat = "table"  # table | json
    top: int = 10  # rows printed for parallelism=auto


@dataclass
class PreflightConfig:
    """Options of launch/preflight.py (``preflight.k=v``; the check validates them)."""

    steps: int = 3  # optimizer steps of the preflight (parity is compared at every step; >= 1)
    timeout_s: float = 600.0  # the ranks' and the reference's time limit, seconds
    wait: bool = False  # Slurm only: wait for the verdict and exit with it
    keep_checkpoint: bool = False  # keep <run_dir>/preflight/ckpt for inspection


@dataclass
class Job:
    """The whole composed job: what every stage (check, plan, render, worker) receives."""

    model: ModelConfig = MISSING
    parallelism: ParallelismConfig = MISSING
    cluster: ClusterConfig = MISSING
    training: TrainingConfig = MISSING
    data: DataConfig = MISSING
    run: RunConfig = field(default_factory=RunConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    dry_run: bool = False  # print the rendered script and composed config; submit nothing
    force: bool = False  # submit despite a failed preflight

    @property
    def world_size(self) -> int:
        return self.cluster.nodes * self.cluster.gpus_per_node

    @property
    def dp(self) -> int:
        """Data-parallel size as Megatron derives it: world // (tp * pp * cp)."""
        mp = self.parallelism.tp * self.parallelism.pp * self.parallelism.cp
        return self.world_size // mp if mp > 0 else 0

    @property
    def num_microbatches(self) -> int:
        """Gradient-accumulation steps per optimizer step: gbs // (mbs * dp) (floored; 0 when there is no dp rank)."""
        denom = self.training.micro_batch_size * self.dp
        return self.training.global_batch_size // denom if denom > 0 else 0

    @property
    def iterations(self) -> Optional[int]:
        """Optimizer steps of the run: ceil(train_tokens / (gbs * seq)) when train_tokens is set (it wins),
        else train_iters; None when neither is set (the check refuses that)."""
        t = self.training
        if t.train_tokens is not None:
            per_step = t.global_batch_size * self.model.seq_length
            return max(1, math.ceil(t.train_tokens / per_step)) if per_step > 0 else None
        return t.train_iters

    @property
    def padded_vocab_size(self) -> int:
        """The vocabulary the ranks build: a multiple of lcm(make_vocab_size_divisible_by, tp) (launch/vocab.py)."""
        m = self.model
        return vocab.padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, self.parallelism.tp)

    @property
    def layout_label(self) -> str:
        """``tp8-pp8-vpp2-sp-sel``: the layout as reports, sweeps and the planner name it."""
        return self.parallelism.label

    @property
    def run_dir(self) -> str:
        return self.run.dir or f"{self.cluster.run_root}/{self.run.name}"

    @property
    def paths(self) -> RunPaths:
        """Every file of this run (:mod:`launch.paths`)."""
        return self.paths_at(self.run_dir)

    def paths_at(self, run_dir: Union[str, Path]) -> RunPaths:
        """The run's files when its directory is ``run_dir`` (a rank gets it as its argument)."""
        return RunPaths.of(run_dir, self.run.name, self.cluster.checkpoint_root)


def choice_fields(cls: Optional[type] = None, prefix: str = "") -> Dict[str, tuple]:
    """Every choice field of the schema below ``cls`` (default: the Job): dotted name -> allowed values,
    read from the ``Annotated[str, Literal[...]]`` annotations (the one list of each choice)."""
    cls = cls or Job
    out: Dict[str, tuple] = {}
    hints = get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        allowed = allowed_values(hint)
        if allowed is not None:
            out[f"{prefix}{f.name}"] = allowed
        elif dataclasses.is_dataclass(hint):
            out.update(choice_fields(hint, f"{prefix}{f.name}."))
    return out


CHOICES: Dict[str, tuple] = choice_fields()  # dotted field -> allowed values (launch/check.py validates them)


def register_configs(cs: Optional[ConfigStore] = None) -> ConfigStore:
    """Register the schema; YAML files extend these via ``defaults: [/schema_<group>]``.

    The group schemas are stored outside their groups (``schema_model``, not ``model/base_model``) so that
    ``--help`` lists only the options a user can pick; a schema alone has no values and would not validate.
    """
    cs = cs or ConfigStore.instance()
    cs.store(name="base_job", node=Job)
    cs.store(name="schema_model", node=ModelConfig)
    cs.store(name="schema_parallelism", node=ParallelismConfig)
    cs.store(name="schema_cluster", node=ClusterConfig)
    cs.store(name="schema_training", node=TrainingConfig)
    cs.store(name="schema_data", node=DataConfig)
    return cs
