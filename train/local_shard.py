"""A rank's shard of the node-local checkpoint tier (:mod:`train.local_ckpt`): what it holds, its host copy, its file
read back as views, and its restore into the model, the optimizer and the scheduler.

What a shard holds: this rank's tensors only (same-layout restore only): for each Megatron optimizer its inner torch
optimizer's parameters (the fp32 main weights, this rank's dp shard with the distributed optimizer) and their Adam
state, plus the grad scaler (fp16); of the model chunks' ``state_dict`` (this rank's tensor/pipeline slice) only
what is not a trainable weight (buffers, frozen weights): the trainable weights are what the main weights hold (cast
to bf16/fp16, all-gathered over dp with the distributed optimizer), so they are rebuilt from them at the restore
(:func:`rebuild_weights`) instead of being written, sent and read a second time; as JSON: the step, the data
position (consumed samples, skipped batches), the scheduler and the optimizer's param groups. No RNG state: the loop
re-seeds every RNG from (seed, step) at each step (:func:`train.train_loop.seed_step`). Tensors are written with
safetensors (no pickle), everything else as JSON, so nothing read back from a node-local directory (which another
job on the node may write) is ever unpickled.
"""
from __future__ import annotations

import json
import warnings
from typing import Any, Dict, List, Optional

import torch

from train.megatron_ckpt import sync_params

FORMAT = "slurmtron-local-shard"


def _inner(optimizer: Any) -> List[Any]:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def trainable_names(module: torch.nn.Module) -> set:
    """The state-dict names of ``module``'s trainable parameters: every one has its fp32 main copy in the optimizer
    (Megatron's optimizers take every parameter that requires a gradient), so a shard does not hold them twice."""
    return {n for n, p in module.named_parameters() if p.requires_grad}


def rebuild_weights(chunks: List[Any], optimizer: Any) -> None:
    """The model's trainable weights from the optimizer's main weights, as an optimizer step leaves them: each
    Megatron optimizer copies its main weights into the model's (``_copy_main_params_to_model_params``, what
    ``step`` calls; a cast for bf16/fp16 weights, this rank's dp slice with the distributed optimizer; the fp32
    optimizer's main weights are the model's own), then, with the distributed optimizer, each chunk all-gathers
    the slices over its data-parallel group (``start_param_sync``, as after a step). Collective on that group."""
    for opt in _inner(optimizer):
        copy = getattr(opt, "_copy_main_params_to_model_params", None)
        if copy is not None:
            copy()
    for c in chunks:
        ddp = getattr(c, "ddp_config", None)
        if ddp is not None and ddp.use_distributed_optimizer:
            c.start_param_sync(force_sync=True)


def host_copies(tensors: Dict[str, torch.Tensor], pinned: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A private, contiguous host-memory copy of each tensor: a clone of a CPU tensor; a GPU tensor copied into a
    pinned host buffer of ``pinned`` (made once per name and reused by every later save, so a save costs no GPU memory
    and no pinning; the next save starts only after the previous one ended,
    :meth:`train.local_ckpt.LocalTier.save`), the copies awaited once at the end."""
    out: Dict[str, torch.Tensor] = {}
    on_gpu = False
    for k, v in tensors.items():
        v = v.detach()
        if v.device.type == "cpu":
            out[k] = v.clone(memory_format=torch.contiguous_format)
            continue
        buf = pinned.get(k)
        if buf is None or buf.shape != v.shape or buf.dtype != v.dtype:
            buf = pinned[k] = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
        out[k] = buf.copy_(v, non_blocking=True)
        on_gpu = True
    if on_gpu:
        torch.cuda.synchronize()
    return out


def shard_state(parts: Any, train_state: Any,
                pinned: Optional[Dict[str, torch.Tensor]] = None) -> tuple[Dict[str, torch.Tensor], dict]:
    """This rank's tensors (name -> a private contiguous copy in host memory, :func:`host_copies`) and its JSON
    state."""
    chunks, optimizer, scheduler = parts
    sync_params(chunks)
    tensors: Dict[str, torch.Tensor] = {}
    for i, c in enumerate(chunks):
        module = getattr(c, "module", c)
        rebuilt = trainable_names(module)  # the optimizer's main weights hold them: rebuilt at restore
        for k, v in module.state_dict().items():
            if torch.is_tensor(v) and k not in rebuilt:
                tensors[f"model{i}/{k}"] = v
    groups: List[List[dict]] = []
    scalars: Dict[str, Any] = {}
    for j, opt in enumerate(_inner(optimizer)):
        inner = opt.optimizer
        groups.append([{k: v for k, v in g.items() if k != "params" and _jsonable(v)} for g in inner.param_groups])
        for gi, g in enumerate(inner.param_groups):
            for pi, p in enumerate(g["params"]):
                tensors[f"optim{j}/main/{gi}/{pi}"] = p
                for key, val in inner.state.get(p, {}).items():
                    if torch.is_tensor(val):
                        tensors[f"optim{j}/state/{gi}/{pi}/{key}"] = val
                    else:
                        scalars[f"optim{j}/state/{gi}/{pi}/{key}"] = val
        scaler = getattr(opt, "grad_scaler", None)
        if scaler is not None:
            for k, v in scaler.state_dict().items():
                if torch.is_tensor(v):
                    tensors[f"optim{j}/scaler/{k}"] = v
                else:
                    scalars[f"optim{j}/scaler/{k}"] = v
    doc = {"format": FORMAT, "training_state": {"step": train_state.step,
                                                "consumed_samples": train_state.consumed_samples,
                                                "data_skips": [list(x) for x in train_state.skips]},
           "scheduler": {k: v for k, v in scheduler.state_dict().items() if _jsonable(v)},
           "param_groups": groups, "scalars": scalars}
    return host_copies(tensors, {} if pinned is None else pinned), doc


# safetensors' dtype names (the format's header) -> torch
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def shard_views(blob: Any) -> Dict[str, torch.Tensor]:
    """The tensors of a safetensors ``blob`` (bytes or a uint8 array) as read-only views of its buffer.

    ``safetensors.torch.load`` copies every tensor out of the blob (0.35 s per 512 MB on the CPU machine, a third
    of a restore) before :func:`restore_shard` copies each into its place again; the views skip the first copy.
    The format: an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, the
    data. A header that does not describe the blob is a ValueError (the file passed its SHA-256 already)."""
    mv = memoryview(blob).cast("B")
    if len(mv) < 8:
        raise ValueError("not a safetensors shard: shorter than its header length")
    n = int.from_bytes(mv[:8], "little")
    if n > len(mv) - 8:
        raise ValueError(f"not a safetensors shard: a header of {n} bytes in {len(mv)}")
    header = json.loads(bytes(mv[8:8 + n]))
    base, out = 8 + n, {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the buffer is not writable: restore_shard only reads it
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _DTYPES.get(info.get("dtype"))
            (b, e), shape = info.get("data_offsets") or (0, -1), list(info.get("shape") or [])
            count = int(torch.Size(shape).numel())
            if dtype is None or not 0 <= b <= e <= len(mv) - base or (e - b) != count * dtype.itemsize:
                raise ValueError(f"the shard's header does not describe its data at {name!r}: {info}")
            flat = (torch.frombuffer(mv, dtype=dtype, count=count, offset=base + b) if count
                    else torch.empty(0, dtype=dtype))
            out[name] = flat.view(shape)
    return out


def restore_shard(parts: Any, tensors: Dict[str, torch.Tensor], doc: dict) -> dict:
    """Copy a shard back into model, optimizer and scheduler (same layout); the training state it records. Every
    tensor is copied to where it belongs (the parameters, the optimizer state on its parameter's device), so
    ``tensors`` may be views of a read buffer (:func:`shard_views`)."""
    chunks, optimizer, scheduler = parts
    if doc.get("format") != FORMAT:
        raise ValueError(f"not a local shard: format {doc.get('format')!r}")
    for i, c in enumerate(chunks):
        module = getattr(c, "module", c)
        own = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith(f"model{i}/")}
        rebuilt = trainable_names(module)  # absent from a shard: rebuild_weights below
        current = {k: v for k, v in module.state_dict().items() if k in own or k not in rebuilt}
        missing = [k for k, v in current.items() if torch.is_tensor(v) and k not in own]
        if missing:
            raise ValueError(f"the local shard lacks {missing[0]} (+{len(missing) - 1}): saved in another layout?")
        with torch.no_grad():
            for k, v in current.items():
                if torch.is_tensor(v):
                    if v.shape != own[k].shape:
                        raise ValueError(f"{k}: shape {tuple(own[k].shape)} in the local shard, {tuple(v.shape)} here")
                    v.copy_(own[k])
    scalars = doc.get("scalars") or {}
    saved_groups = doc.get("param_groups") or []
    for j, opt in enumerate(_inner(optimizer)):
        inner = opt.optimizer
        if j >= len(saved_groups) or len(saved_groups[j]) != len(inner.param_groups):
            raise ValueError(f"optimizer {j}: {len(inner.param_groups)} param groups here, the local shard has "
                             f"{len(saved_groups[j]) if j < len(saved_groups) else 0}: saved in another layout?")
        for gi, g in enumerate(inner.param_groups):
            g.update(saved_groups[j][gi])  # lr, weight decay, ... (the scheduler sets lr and wd again below)
            for pi, p in enumerate(g["params"]):
                with torch.no_grad():
                    p.copy_(tensors[f"optim{j}/main/{gi}/{pi}"])
                prefix = f"optim{j}/state/{gi}/{pi}/"
                state = {k[len(prefix):]: v.to(p.device, copy=True) for k, v in tensors.items() if k.startswith(prefix)}
                state.update({k[len(prefix):]: v for k, v in scalars.items() if k.startswith(prefix)})
                if state:
                    inner.state[p] = state
        scaler = getattr(opt, "grad_scaler", None)
        if scaler is not None:
            sd = {k.rsplit("/", 1)[1]: v.clone() for k, v in tensors.items() if k.startswith(f"optim{j}/scaler/")}
            sd.update({k.rsplit("/", 1)[1]: v for k, v in scalars.items() if k.startswith(f"optim{j}/scaler/")})
            scaler.load_state_dict(sd)
    rebuild_weights(chunks, optimizer)
    scheduler.num_steps = 0  # Megatron's load_state_dict adds the saved count (train/megatron_ckpt.py)
    scheduler.load_state_dict(doc["scheduler"])
    return doc["training_state"]
