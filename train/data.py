"""Training data: a deterministic mock dataset, or Megatron's GPT dataset (or weighted blend) over .bin/.idx files.

Both are random-access by *global sample index*, and the loop asks for samples by index:
step ``s`` of a run consumes global samples ``[consumed, consumed + gbs)`` where
``consumed`` is part of the checkpointed training state. Inside one global batch, data
parallel rank ``r`` takes, for microbatch ``m``, the samples
``consumed + m * mbs * dp + r * mbs + [0, mbs)`` (Megatron's pretraining sampler order).
So a resume (in any layout) neither repeats nor skips a sample, and the union over dp ranks
is the same global batch whatever dp is.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Protocol

import numpy as np
import torch

from launch.config import DataConfig, ModelConfig
from launch import blend
from launch.tokenizer import TokenizerError, get_tokenizer, under_root


class SampleSource(Protocol):
    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]: ...


class MockGPTDataset:
    """Synthetic sequences ``(start + stride * t) mod V``: deterministic in (seed, index), learnable.

    ``V = min(vocab - 1, 64)`` (EOD left out): the model first learns which tokens occur
    (the loss drops from ``ln(padded vocab)`` towards ``ln(V)`` within a few steps, which is
    what the demo and tests look for), then to infer each sequence's stride from the context.
    Throughput does not depend on the token values, so benchmarks can use it too.
    """

    def __init__(self, seq_length: int, vocab_size: int, seed: int) -> None:
        self.seq_length = seq_length
        self.modulus = max(2, min(vocab_size - 1, 64))
        self.seed = seed

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        rng = np.random.default_rng([self.seed, int(idx)])
        start = int(rng.integers(self.modulus))
        stride = int(rng.integers(1, 8))
        seq = (start + stride * np.arange(self.seq_length + 1)) % self.modulus
        seq_t = torch.from_numpy(seq.astype(np.int64))
        return {
            "tokens": seq_t[:-1].clone(),
            "labels": seq_t[1:].clone(),
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float32),
            "position_ids": torch.arange(self.seq_length, dtype=torch.int64),
        }


def build_indexed_dataset(
    data: DataConfig, seq_length: int, num_samples: int, cache_dir: Path, tokenizer: Any,
    num_valid: int = 0, data_root: str = "",
) -> Any:
    """Megatron-Core's GPT dataset over ``data.path`` or the weighted ``data.blend`` (a ``BlendedDataset``
    built by Megatron's ``BlendedMegatronDatasetBuilder``): the train split, or (train, validation) when
    ``num_valid`` > 0. The validation split is ``data.split``'s share of the same prefixes, or
    ``data.valid_blend`` (Megatron's ``blend_per_split``). Call on every rank."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    train = blend.train_sources(data, data_root)
    valid = blend.valid_sources(data, data_root)
    if not train:
        raise ValueError("data.kind=indexed needs data.path or data.blend (prefixes made by python -m launch.preprocess)")
    for src in train + valid:
        for suffix in (".bin", ".idx"):
            if not Path(src.path + suffix).exists():
                raise FileNotFoundError(f"{src.field}={src.path!r}: {src.path + suffix} does not exist")
    if valid:
        which = dict(blend_per_split=[blend.megatron_blend(train),
                                      blend.megatron_blend(valid) if num_valid else None, None])
    else:
        which = dict(blend=blend.megatron_blend(train), split=data.split)
    config = GPTDatasetConfig(
        random_seed=data.seed,
        sequence_length=seq_length,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=str(cache_dir),
        mid_level_dataset_surplus=blend.MID_LEVEL_SURPLUS,
        **which,
    )
    train_ds, valid_ds, _test = BlendedMegatronDatasetBuilder(
        GPTDataset, [num_samples, num_valid, 0], lambda: True, config
    ).build()
    if num_valid:
        if valid_ds is None:
            raise ValueError(f"data.split={data.split!r} has no validation split; set e.g. data.split=98,2,0")
        return train_ds, valid_ds
    return train_ds


def build_validation_source(data: DataConfig, model: ModelConfig, num_samples: int, num_valid: int,
                            cache_dir: Path, data_root: str = "") -> SampleSource:
    """The validation split: held-out documents of the indexed dataset, or mock sequences from another seed."""
    if data.kind == "mock":
        return MockGPTDataset(model.seq_length, model.vocab_size, data.seed + 1)
    tokenizer = get_tokenizer(under_root(data.tokenizer, data_root))
    return build_indexed_dataset(data, model.seq_length, num_samples, cache_dir, tokenizer, num_valid, data_root)[1]


def build_source(data: DataConfig, model: ModelConfig, num_samples: int, cache_dir: Path,
                 data_root: str = "") -> SampleSource:
    """The dataset named by ``data.kind``; an indexed one needs ``model.vocab_size`` = the tokenizer's vocabulary."""
    if data.kind == "mock":
        return MockGPTDataset(model.seq_length, model.vocab_size, data.seed)
    if data.kind == "indexed":
        tokenizer = get_tokenizer(under_root(data.tokenizer, data_root))
        if model.vocab_size != tokenizer.vocab_size:
            raise ValueError(f"model.vocab_size={model.vocab_size} != data.tokenizer {data.tokenizer!r} vocabulary "
                             f"{tokenizer.vocab_size}; set model.vocab_size={tokenizer.vocab_size}")
        return build_indexed_dataset(data, model.seq_length, num_samples, cache_dir, tokenizer, data_root=data_root)
    raise ValueError(f"data.kind={data.kind!r}; expected mock | indexed")


def start_refusal(data: DataConfig, data_root: str = "") -> Optional[Dict[str, str]]:
    """Why this node cannot read the job's data, before anything is built: ``{reason, detail}`` with a final
    stop reason of :data:`recovery.policy.FINAL_REASONS` (another attempt would meet the same files), or None.
    A tokenizer package missing on the compute nodes is ``unsupported_software``; a prefix or tokenizer file
    missing or unreadable here (a mount the login node has and this node lacks) is ``storage_error``."""
    if data.kind != "indexed":
        return None
    try:
        get_tokenizer(under_root(data.tokenizer, data_root))
        sources = blend.train_sources(data, data_root) + blend.valid_sources(data, data_root)
    except TokenizerError as e:
        return {"reason": "unsupported_software" if e.package else "storage_error", "detail": str(e)}
    except blend.BlendError as e:
        return {"reason": "storage_error", "detail": str(e)}
    missing = [s.path + ext for s in sources for ext in (".bin", ".idx") if not Path(s.path + ext).is_file()]
    if missing:
        return {"reason": "storage_error", "detail": f"data files missing on this node: {', '.join(missing)} "
                                                     "(the job check saw them on the login node: a shared mount?)"}
    return None


def per_source(source: Any, num_samples: int, consumed: int) -> Optional[Dict[str, List[int]]]:
    """A blend's samples per source over the run's ``num_samples`` and over the ``consumed`` ones so far
    (Megatron's ``dataset_index``: which source each global sample comes from, fixed by seed and size);
    None for a single dataset."""
    index = getattr(source, "dataset_index", None)
    if index is None:
        return None
    n = len(source.datasets)
    return {"samples": np.bincount(np.asarray(index[:num_samples]), minlength=n).tolist(),
            "consumed": np.bincount(np.asarray(index[:consumed]), minlength=n).tolist()}


def describe(data: DataConfig, source: Any, num_samples: int, consumed: int, data_root: str = "") -> Dict[str, Any]:
    """The resolved data of a run for the start log and the ``data`` event: seed, sources, weights, counts."""
    info: Dict[str, Any] = {"kind": data.kind, "seed": data.seed, "tokenizer": data.tokenizer,
                            "num_samples": num_samples, "consumed_samples": consumed}
    if data.kind != "indexed":
        return info
    sources = blend.train_sources(data, data_root)
    counts = per_source(source, num_samples, consumed) or {"samples": [num_samples], "consumed": [consumed]}
    info["sources"] = [
        {"path": s.path, "weight": s.weight, "share": round(w, 6), "samples": n, "consumed": c}
        for s, w, n, c in zip(sources, blend.normalized(sources), counts["samples"], counts["consumed"])
    ]
    if data.valid_blend:
        info["valid_sources"] = [{"path": s.path, "weight": s.weight} for s in blend.valid_sources(data, data_root)]
    return info


def data_changes(before: Optional[Dict[str, Any]], now: Dict[str, Any]) -> List[str]:
    """What differs between the data of the previous attempt (its ``data`` event) and this one's: a changed
    seed, tokenizer, blend or run length gives other samples from here on (Megatron's shuffles depend on them),
    so a resume is then no longer the same run's continuation."""
    if not before:
        return []
    out = []
    for key in ("kind", "seed", "tokenizer", "num_samples"):
        if before.get(key) != now.get(key):
            out.append(f"{key} {before.get(key)!r} -> {now.get(key)!r}")
    blend_of = lambda info: [(s["path"], s["weight"]) for s in info.get("sources", [])]  # noqa: E731
    if blend_of(before) != blend_of(now):
        out.append(f"blend {blend_of(before)} -> {blend_of(now)}")
    return out


def describe_line(info: Dict[str, Any]) -> str:
    """One log line of :func:`describe`."""
    head = f"data: {info['kind']}, seed {info['seed']}, tokenizer {info['tokenizer']}, {info['num_samples']} samples"
    if "sources" not in info:
        return head
    parts = [f"{s['path']} weight {s['weight']:g} ({100 * s['share']:.1f}%): {s['samples']} samples "
             f"({100 * s['samples'] / max(1, info['num_samples']):.1f}%), {s['consumed']} consumed"
             for s in info["sources"]]
    return head + f"; consumed {info['consumed_samples']}; " + "; ".join(parts)


def microbatch_indices(consumed: int, num_microbatches: int, mbs: int, dp: int, dp_rank: int) -> List[List[int]]:
    """Global sample indices of this dp rank's microbatches for the step starting at ``consumed``."""
    return [
        [consumed + m * mbs * dp + dp_rank * mbs + j for j in range(mbs)] for m in range(num_microbatches)
    ]


def collate(samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    keys = ("tokens", "labels", "loss_mask", "position_ids")
    return {k: torch.stack([s[k] for s in samples]) for k in keys}


def step_batches(
    source: SampleSource, consumed: int, num_microbatches: int, mbs: int, dp: int, dp_rank: int
) -> List[Dict[str, torch.Tensor]]:
    """The microbatches this rank feeds to the schedule for one optimizer step."""
    return [
        collate([source[i] for i in idx])
        for idx in microbatch_indices(consumed, num_microbatches, mbs, dp, dp_rank)
    ]
