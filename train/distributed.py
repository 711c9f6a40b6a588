"""The distributed set-up every rank program shares (the training worker and the preflight).

:func:`distributed` initialises torch.distributed (NCCL with CUDA, gloo without; the CPU shim
without CUDA) and Megatron-Core's ``parallel_state`` for the job's layout, and tears both down
at the end, whatever happened in between.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import sys
from typing import Any, Iterator, Mapping, NamedTuple, Optional

from launch import dist_env
from recovery.signals import deferred
from train.async_ckpt import WriterWarmUp

# torch, Megatron-Core and train.cpu_shim (torch) are imported inside the functions: quiet_known_warnings runs first.


class Device(NamedTuple):
    """Where this rank computes."""

    cuda: bool
    device: Any  # torch.device
    writer_warmup: Any = None  # train.async_ckpt.WriterWarmUp: join before the first save


KNOWN_WARNINGS = (  # Megatron-Core 0.16 / torch 2.x on a machine without Apex or TransformerEngine, every launch
    ".*Transformer Engine and Apex are not installed.*", ".*Apex is not installed.*",
    ".*CUDA_DEVICE_MAX_CONNECTIONS.*", ".*full scope is deprecated.*",
    ".*`load_state_dict` is deprecated and will be removed.*",
    ".*Please use DTensor instead and we are deprecating ShardedTensor.*",
)


def quiet_known_warnings(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Filter the warnings Megatron-Core and torch print at every rank start (Apex/TE absent, deprecations the
    toolkit cannot act on); returns the one line that says so, or None when ``PYTHONWARNINGS`` is set (the user
    asked for their own filters)."""
    import warnings

    if (env or {}).get("PYTHONWARNINGS"):
        return None
    for pattern in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    return (f"note: {len(KNOWN_WARNINGS)} known Megatron-Core/torch warnings are filtered (Apex/TransformerEngine "
            "absent, deprecations); PYTHONWARNINGS=default shows them")


def init_distributed(job: Any, denv: Any, *, timeout_s: float, checkpoint_helpers: bool = False) -> Device:
    """Join the process group of ``denv`` and build Megatron's parallel groups for ``job``.

    ``checkpoint_helpers``: start dist_checkpointing's helper process now, with the stop
    signals blocked (see :func:`start_checkpoint_helpers`).
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from train import cpu_shim

    quiet_known_warnings(os.environ)
    cuda = torch.cuda.is_available()
    if not cuda:
        cpu_shim.apply()
    if denv.world_size != job.world_size:
        raise ValueError(
            f"{denv.world_size} ranks started but the job wants cluster.nodes * cluster.gpus_per_node = "
            f"{job.cluster.nodes} * {job.cluster.gpus_per_node} = {job.world_size}"
        )
    if cuda:
        torch.cuda.set_device(denv.local_rank)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group(
        backend=dist_env.backend(cuda), init_method=denv.init_method, rank=denv.rank,
        world_size=denv.world_size, timeout=datetime.timedelta(seconds=timeout_s),
    )
    warmup = start_checkpoint_helpers() if checkpoint_helpers else None
    p = job.parallelism
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vpp, context_parallel_size=p.cp,
        expert_model_parallel_size=p.ep,
    )
    return Device(cuda, device, warmup)


def shutdown_distributed() -> None:
    """Destroy Megatron's parallel groups and the process group (safe after a partial init, including one that
    failed to import Megatron-Core: then there are no groups of its to destroy, and it is not imported again)."""
    import torch.distributed as dist

    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None:
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def distributed(job: Any, denv: Any, *, timeout_s: float, checkpoint_helpers: bool = False) -> Iterator[Device]:
    """:func:`init_distributed` for the ``with`` block, :func:`shutdown_distributed` after it."""
    try:
        yield init_distributed(job, denv, timeout_s=timeout_s, checkpoint_helpers=checkpoint_helpers)
    finally:
        shutdown_distributed()


def start_checkpoint_helpers() -> Any:
    """Start dist_checkpointing's helper processes now, with the stop signals blocked.

    Slurm signals every process of the job step, and Megatron-Core's writer-results queue lives
    in a spawned Manager process that starts with the default action (terminate) for SIGTERM
    and SIGUSR2. Started lazily inside the first save, it costs that save an interpreter boot
    (seconds) and, started unprotected, it dies on the very preemption SIGTERM whose
    checkpoint it must carry. Spawned under the mask, it inherits the mask and survives.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    with deferred():
        filesystem_async._get_write_results_queue()
    # the manager has imported nothing yet: its first unpickling of write results imports torch (the "cold
    # writer"); a round trip in the background pays that now (train/async_ckpt.py, warm_results_queue)
    return WriterWarmUp().start()
