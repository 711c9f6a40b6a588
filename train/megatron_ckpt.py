"""Distributed checkpoints of model + optimizer + training state (Megatron-Core dist_checkpointing).

Layout of one checkpoint (``torch_dist`` format, written by every rank into the staging
directory of :mod:`recovery.commit`, then committed by rank 0)::

    iter_0000010/  __0_0.distcp ...   model and optimizer shards (dist_checkpointing)
                   common.pt          the common state below
                   metadata.json      dist_checkpointing's own
                   manifest.json      recovery.commit: checksums + the worker's meta

The common state holds ``training_state`` (step, consumed samples, restart count, seed,
layout, optimizer type) and ``opt_param_scheduler``. RNG states are not stored: the loop
re-seeds every RNG from (seed, step) at each step (:func:`train.train_loop.seed_step`),
which makes a resume bitwise equal to an uninterrupted run in *any* layout.

The distributed optimizer (Megatron-Core 0.16 without Apex/TE) has three load bugs that
:func:`fix_distributed_optimizer_load` and the two helpers below work around
(``../shared/notes/megatron-core-on-cpu.md``):

(a) ``state_dict()`` on a fresh optimizer asserts ``len(steps) == 1``: :func:`prime_optimizer_state`
    (on load, and on a save before any update was applied: fp16 loss-scale overflows skip them);
(b) loading copies every live state key, including ``step``, which the checkpoint lacks
    (``KeyError: 'step'``): the patched ``_set_main_param_and_optimizer_states`` skips it;
(c) silently, after loading every parameter shares ONE ``step`` tensor, which torch Adam
    increments once per parameter per step: :func:`unshare_step` gives each its own copy.

And one save bug: (d) with several gradient buckets (``overlap_grad_reduce``), the ``fully_reshardable``
state is gathered with the padding at the end of each bucket stripped, then sliced by the parameters'
*padded* buffer offsets, so every parameter after the first bucket saved a neighbour's main weight and
Adam moments (``sharded_param_state_fully_reshardable``; fixed upstream in Megatron-LM #5077, after
0.16.1): :func:`bucket_padded_state` puts the padding back while the optimizer state dict is built.
"""
from __future__ import annotations

import inspect
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List

import torch
from megatron.core import dist_checkpointing

from recovery.pickle_guard import unsafe_pickles
from recovery.policy import EXIT_UNSAFE_CKPT
from recovery.start_check import optimizer_conflict

DIST_OPT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


class UnsafeCheckpoint(RuntimeError):
    """A checkpoint about to be loaded holds a pickle that needs more than checkpoint data types
    (:mod:`recovery.pickle_guard`): a final stop (``stop`` as in :class:`recovery.savefail.SaveFailed`)."""

    def __init__(self, path: Path, why: str) -> None:
        detail = (f"{path} was not loaded: {why}. Checkpoints this toolkit writes need only checkpoint data "
                  f"types, so it was changed after its save; find out who changed it")
        self.stop = {"reason": "unsafe_checkpoint", "code": EXIT_UNSAFE_CKPT, "detail": detail}
        super().__init__(detail)


def refuse_unsafe_pickles(path: Path) -> None:
    """Every rank, right before a load: the files torch would unpickle must pass the allow-list (rank 0's start
    decision checked them too; this closes the window between that check and the load)."""
    why = unsafe_pickles(Path(path))
    if why:
        raise UnsafeCheckpoint(Path(path), why)


class CheckpointMismatch(RuntimeError):
    """A checkpoint this job must not load (written by the other optimizer type)."""


def inner_optimizers(optimizer: Any) -> List[Any]:
    """The Megatron optimizers inside a ChainedOptimizer (or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _is_distributed(opt: Any) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(opt, DistributedOptimizer)


def fix_distributed_optimizer_load() -> None:
    """Bug (b): when restoring param state, keep live keys the checkpoint does not carry."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if getattr(DistributedOptimizer, "_slurmtron_load_fix", False):
        return

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        dst = {"param": main_param, **self.optimizer.state[main_param]}
        for key, value in tensors.items():
            if key in dst:
                dst[key].copy_(value)

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    DistributedOptimizer._slurmtron_load_fix = True


def prime_optimizer_state(optimizer: Any) -> None:
    """Bug (a): give a fresh distributed optimizer's inner Adam a zero state with ``step``."""
    for opt in inner_optimizers(optimizer):
        if not _is_distributed(opt):
            continue
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if len(inner.state[p]) == 0:
                    inner.state[p] = {
                        "step": torch.tensor(0.0, dtype=torch.float32),
                        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                    }


def unshare_step(optimizer: Any) -> None:
    """Bug (c): one ``step`` tensor per parameter, as a fresh torch Adam has."""
    for opt in inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for state in inner.state.values():
            if "step" in state and torch.is_tensor(state["step"]):
                state["step"] = state["step"].detach().clone()


def _pad_bucket_ends(opt: Any, state: Dict[Any, Any]) -> None:
    """Re-insert each bucket's end padding into the gathered world tensors (zeros), so that
    ``param_index_map``'s buffer offsets index them."""
    for gbuf_idx, buffer in enumerate(opt.buffers):
        for world in state[gbuf_idx].values():
            for key in ("param", "exp_avg", "exp_avg_sq"):
                compact = world.get(key)
                if compact is None:
                    continue
                padded = compact.new_zeros(buffer.numel)
                src = 0
                for bucket in buffer.buckets:
                    n = bucket.numel_unpadded
                    padded[bucket.offset:bucket.offset + n] = compact[src:src + n]
                    src += n
                world[key] = padded


@contextmanager
def bucket_padded_state(optimizer: Any) -> Iterator[None]:
    """Bug (d): while the optimizer's sharded state dict is built, hand it padded world tensors.
    A no-op for a Megatron-Core whose ``fully_reshardable`` save already accounts for the padding."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    fixed = "cumulative_padding_stripped" in inspect.getsource(
        DistributedOptimizer.sharded_param_state_fully_reshardable)
    targets = [] if fixed else [o for o in inner_optimizers(optimizer) if _is_distributed(o)]
    for opt in targets:
        def padded(*args: Any, _opt: Any = opt, **kwargs: Any) -> Any:
            state = DistributedOptimizer.get_parameter_state_dp_zero(_opt, *args, **kwargs)
            if state is not None:
                _pad_bucket_ends(_opt, state)
            return state
        opt.get_parameter_state_dp_zero = padded
    try:
        yield
    finally:
        for opt in targets:
            del opt.get_parameter_state_dp_zero


def sync_params(chunks: List[Any]) -> None:
    """With ``parallelism.overlap_param_gather`` the weights an optimizer step updated are all-gathered
    lazily, bucket by bucket in the next forward pass (Megatron DDP's forward pre-hooks): gather them now,
    synchronously, before anything reads the weights outside a forward pass (a save, a parameter digest),
    as Megatron-LM's ``save_checkpoint_and_time`` does. A no-op without the overlap."""
    for c in chunks:
        if getattr(c, "use_forward_hook", False):
            c.start_param_sync(force_sync=True)


def sharded_state(
    chunks: List[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    training_state: Dict[str, Any],
    *,
    distributed_optimizer: bool,
    is_loading: bool,
) -> Dict[str, Any]:
    """The state dict handed to dist_checkpointing (model keys taken from the unwrapped modules)."""
    sd: Dict[str, Any] = {}
    if not is_loading:
        sync_params(chunks)
    modules = [getattr(c, "module", c) for c in chunks]  # DDP prefixes keys with module.
    if len(modules) == 1:
        sd["model"] = modules[0].sharded_state_dict()
    else:
        for i, m in enumerate(modules):
            sd[f"model{i}"] = m.sharded_state_dict()
    if distributed_optimizer:  # loading, or saving before any update was applied (fp16 overflows skip them all)
        prime_optimizer_state(optimizer)
    metadata = DIST_OPT_METADATA if distributed_optimizer else None
    with bucket_padded_state(optimizer):
        sd["optimizer"] = optimizer.sharded_state_dict(sd, is_loading=is_loading, metadata=metadata)
    sd["opt_param_scheduler"] = scheduler.state_dict()
    sd["training_state"] = dict(training_state)
    return sd


@dataclass
class Loaded:
    """What a load restored besides the tensors (already copied into model and optimizer)."""

    training_state: Dict[str, Any]
    seconds: float


@contextmanager
def no_zip_crc32() -> Iterator[None]:
    """``torch.save`` without the zip CRC32 of every record, for the checkpoint writes inside the block.

    dist_checkpointing writes every tensor with ``torch.save`` (a zip record), which computes a CRC32 of
    every byte (4.4 GB per CPU-second on the CPU machine: 0.37 CPU-seconds per 1.6 GB save, on the cores
    the writers and training share). Nothing ever checks it: ``torch.load`` loads a record whose bytes no
    longer match its CRC without a word (tests/test_commit_checksum.py shows it), and ``.distcp`` files
    are not zip archives a tool could test. What does protect the bytes is the manifest's SHA-256 of
    every file, verified before every load (:mod:`recovery.commit`). ``torch.serialization.
    set_crc32_options`` is torch's public switch ("torch.load will be able to load the file"); the
    forked writers inherit it at the fork, so the block must include the scheduling of an async write.
    The previous setting is restored after the block."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def save_shards(path: Path, state: Dict[str, Any], *, distributed_optimizer: bool) -> None:
    """Every rank: write its shards of ``state`` into ``path`` (an existing, empty directory)."""
    with no_zip_crc32():
        dist_checkpointing.save(
            state,
            str(path),
            content_metadata=DIST_OPT_METADATA if distributed_optimizer else None,
        )


def own_shard_files(staging: Path, rank: int) -> List[str]:
    """The shard files rank ``rank`` wrote into ``staging``: torch's FileSystemWriter (and Megatron-Core's
    async one) name them ``__<rank>_<n>.distcp``. A file this misses is not lost: the commit hashes every file
    no rank sealed."""
    prefix = f"__{rank}_"
    return sorted(p.name for p in Path(staging).iterdir()
                  if p.is_file() and p.name.startswith(prefix) and p.name.endswith(".distcp"))


def start_shards_async(path: Path, state: Dict[str, Any], *, distributed_optimizer: bool) -> Any:
    """Every rank: plan the save of ``state`` into ``path`` and write ``common.pt`` (rank 0) now; the shard
    write is the returned ``AsyncRequest``, to schedule with :class:`train.async_ckpt.AsyncWriter` (which forks
    its writer inside :func:`no_zip_crc32`)."""
    with no_zip_crc32():
        return dist_checkpointing.save(
            state,
            str(path),
            content_metadata=DIST_OPT_METADATA if distributed_optimizer else None,
            async_sharded_save=True,
        )


def check_optimizer_type(saved: Dict[str, Any], distributed_optimizer: bool, path: Path) -> None:
    """Refuse a checkpoint written by the other optimizer type (their formats are incompatible); the
    comparison is :func:`recovery.start_check.optimizer_conflict`, which the login side asks too."""
    conflict = optimizer_conflict(saved, distributed_optimizer, path)
    if conflict:
        raise CheckpointMismatch(conflict.line)


def load(
    path: Path,
    chunks: List[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    *,
    distributed_optimizer: bool,
    clock: Callable[[], float] = time.monotonic,
) -> Loaded:
    """Every rank: restore model, optimizer and scheduler from ``path`` (in any saved layout)."""
    t0 = clock()
    refuse_unsafe_pickles(path)
    common = dist_checkpointing.load_common_state_dict(str(path))
    check_optimizer_type(common.get("training_state", {}), distributed_optimizer, path)
    fix_distributed_optimizer_load()
    template = sharded_state(chunks, optimizer, scheduler, {}, distributed_optimizer=distributed_optimizer,
                             is_loading=True)
    state = dist_checkpointing.load(template, str(path))
    modules = [getattr(c, "module", c) for c in chunks]
    if len(modules) == 1:
        modules[0].load_state_dict(state["model"])
    else:
        for i, m in enumerate(modules):
            m.load_state_dict(state[f"model{i}"])
    optimizer.load_state_dict(state["optimizer"])
    unshare_step(optimizer)
    # Megatron's load_state_dict *adds* the saved step count (step(increment=num_steps)), as for a fresh
    # scheduler; a scheduler that already stepped (a NaN rollback in the same process) would land past its target.
    scheduler.num_steps = 0
    scheduler.load_state_dict(state["opt_param_scheduler"])
    return Loaded(training_state=dict(state.get("training_state") or common.get("training_state") or {}),
                  seconds=clock() - t0)
