"""Training data: a deterministic mock dataset, or Megatron's GPT dataset over .bin/.idx files.

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
from typing import Any, Dict, List, Protocol

import numpy as np
import torch

from launch.config import DataConfig, ModelConfig
from launch.tokenizer import ByteTokenizer, get_tokenizer


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
    data: DataConfig, seq_length: int, num_samples: int, cache_dir: Path, tokenizer: ByteTokenizer,
    num_valid: int = 0,
) -> Any:
    """Megatron-Core's GPTDataset over ``data.path``: the train split, or (train, validation) when
    ``num_valid`` > 0 (the validation split of ``data.split``); call on every rank."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    if not data.path:
        raise ValueError("data.kind=indexed needs data.path (a prefix made by python -m launch.preprocess)")
    for suffix in (".bin", ".idx"):
        if not Path(data.path + suffix).exists():
            raise FileNotFoundError(f"data.path={data.path!r}: {data.path + suffix} does not exist")
    config = GPTDatasetConfig(
        random_seed=data.seed,
        sequence_length=seq_length,
        blend=([data.path], None),
        split=data.split,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=str(cache_dir),
    )
    train, valid, _test = BlendedMegatronDatasetBuilder(
        GPTDataset, [num_samples, num_valid, 0], lambda: True, config
    ).build()
    if num_valid:
        if valid is None:
            raise ValueError(f"data.split={data.split!r} has no validation split; set e.g. data.split=98,2,0")
        return train, valid
    return train


def build_validation_source(data: DataConfig, model: ModelConfig, num_samples: int, num_valid: int,
                            cache_dir: Path) -> SampleSource:
    """The validation split: held-out documents of the indexed dataset, or mock sequences from another seed."""
    tokenizer = get_tokenizer(data.tokenizer)
    if data.kind == "mock":
        return MockGPTDataset(model.seq_length, model.vocab_size, data.seed + 1)
    return build_indexed_dataset(data, model.seq_length, num_samples, cache_dir, tokenizer, num_valid)[1]


def build_source(data: DataConfig, model: ModelConfig, num_samples: int, cache_dir: Path) -> SampleSource:
    """The dataset named by ``data.kind``."""
    tokenizer = get_tokenizer(data.tokenizer)
    if model.vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"model.vocab_size={model.vocab_size} < tokenizer {data.tokenizer!r} vocab {tokenizer.vocab_size}"
        )
    if data.kind == "mock":
        return MockGPTDataset(model.seq_length, model.vocab_size, data.seed)
    if data.kind == "indexed":
        return build_indexed_dataset(data, model.seq_length, num_samples, cache_dir, tokenizer)
    raise ValueError(f"data.kind={data.kind!r}; expected mock | indexed")


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
