"""``python -m train.export RUN_DIR --out DIR [--step N] [--dtype D]``: a run's checkpoint as a Hugging Face model.

Loads the newest *verified* checkpoint of the run (or step N), saved in any layout, into one TP1/PP1 model in
this process (a one-rank gloo group of its own: no launcher, no Slurm, CPU is enough), maps it to
``LlamaForCausalLM`` or ``GPT2LMHeadModel`` (:mod:`train.hf_bridge`) and writes ``config.json``, ``model.safetensors`` (sharded with
``model.safetensors.index.json`` past ``--max-shard-size``), the tokenizer when the run used ``hf:``, and
``slurmtron_export.json`` (source, step, dtype and the logits check). The vocabulary is the tokenizer's
(``model.vocab_size``): the rows the run padded it with are cut, and kept beside the weights for an import
(:mod:`train.hf_bridge`). Every file gets the mode a plain ``open()`` would give (``0o666 & ~umask``). Before it says done it loads the written
directory back with ``transformers`` and compares its logits with the Megatron model's on a probe batch
(float32: max abs difference <= :data:`FP32_TOLERANCE` and the same greedy tokens, else exit 3, nothing kept).

The output is staged next to ``--out`` and renamed into place at the end: a failed export leaves nothing.

Exit codes: 0 written; 2 bad argument or input (no run, a model with no HF equivalent, ``--out`` not empty);
3 the written model does not reproduce the checkpoint's logits; 5 no verified checkpoint (``EXIT_NO_LOADABLE``);
7 a storage error; 12 an unsafe pickle in the checkpoint (``EXIT_UNSAFE_CKPT``); 13 a checkpoint other users can
write (``EXIT_SHARED_CKPT``; ``SLURMTRON_TRUST_SHARED_CHECKPOINTS=1`` accepts it).
"""
from __future__ import annotations

import argparse
import json
import re
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from launch import hf_config
from launch.compose import load_job
from launch.paths import RunDirError, RunPaths, given_run_dir, unwritable_ancestor
from launch.tokenizer import get_tokenizer
from launch.vocab import padded_vocab_size
from recovery import policy
from recovery.commit import dir_name, verify
from recovery.pickle_guard import unsafe_pickles
from recovery.resume import find_latest_verified
from recovery.storage import StorageError
from recovery.trust import TRUST_ENV, trusts_shared, writable_by_others

EXIT_LOGITS = 3
FP32_TOLERANCE = 1e-4  # max |logit difference| of a float32 export (observed ~1e-6 on the tiny model)
RECORD = "slurmtron_export.json"
DTYPES = ("float32", "bfloat16", "float16")

class Refused(Exception):
    def __init__(self, code: int, line: str) -> None:
        super().__init__(line)
        self.code = code


@dataclass
class Source:
    job: Any
    run_dir: Path
    path: Path
    step: int
    skipped: list


def find_source(run_dir: Path, step: Optional[int], env: dict) -> Source:
    """The run's job and the verified checkpoint to export (refusals: one line, a distinct code)."""
    cfg = RunPaths.of(run_dir).config
    if not cfg.is_file():
        raise Refused(2, f"{run_dir} is not a run directory (no config.yaml); give the directory launch/pretrain.py "
                         f"created (runs/NAME)")
    try:
        job = load_job(cfg)
    except Exception as e:  # any unreadable config is one line
        raise Refused(2, f"{cfg} cannot be read as a job ({type(e).__name__}: {str(e).splitlines()[0][:300]})")
    if (why := hf_config.unsupported(job.model)) is not None:
        raise Refused(2, f"model {job.model.name}: {why}; nothing was written")
    root = job.paths_at(run_dir).checkpoints
    try:
        if step is not None:
            path = root / dir_name(step)
            reason = verify(path)
            if reason is not None:
                raise Refused(policy.EXIT_NO_LOADABLE, f"{path} is not a verified checkpoint: {reason}; "
                                                       f"`python -m recovery.resume {run_dir}` lists the loadable ones")
            skipped = []
        else:
            res = find_latest_verified(root)
            if res.path is None:
                why = f" ({res.skipped[0][0].name}: {res.skipped[0][1]})" if res.skipped else ""
                raise Refused(policy.EXIT_NO_LOADABLE, f"{root} holds no verified checkpoint{why}; nothing to export")
            path, step, skipped = res.path, int(res.step), res.skipped
        unsafe = unsafe_pickles(path)
        if unsafe:
            raise Refused(policy.EXIT_UNSAFE_CKPT, f"{path} was not loaded: {unsafe}; checkpoints this toolkit writes "
                                                   f"need only checkpoint data types, so it was changed after its save")
        shared = writable_by_others(root, path)
        if shared and not trusts_shared(env):
            raise Refused(policy.EXIT_SHARED_CKPT, f"{shared}: another user could have changed it; make it private "
                                                   f"(chmod -R go-w {root}) or set {TRUST_ENV}=1")
    except StorageError as e:
        raise Refused(policy.EXIT_STORAGE, f"cannot read the checkpoints of {run_dir}: {e}")
    except OSError as e:
        raise Refused(policy.EXIT_STORAGE, f"cannot read the checkpoints of {run_dir}: {e}")
    return Source(job, run_dir, path, int(step), skipped)


def probe_tokens(model: Any) -> Any:
    """A fixed batch (2 x min(32, seq)) of token ids of the real vocabulary, the same for every export."""
    import torch

    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, model.vocab_size, (2, min(32, model.seq_length)), generator=gen)


def compare_logits(mine: Any, theirs: Any) -> dict:
    """Max abs difference and greedy agreement of two [b, s, v] logits tensors, over the columns of ``theirs`` (the
    HF model's: the tokenizer's ids; Megatron's padded columns are no token)."""
    mine = mine[..., :theirs.shape[-1]]
    diff = float((mine.float() - theirs.float()).abs().max())
    greedy = bool((mine.argmax(-1) == theirs.argmax(-1)).all())
    return {"max_abs_diff": diff, "greedy_equal": greedy}


def hf_model(job: Any, tensors: dict, dtype: str) -> Any:
    """A ``LlamaForCausalLM`` or ``GPT2LMHeadModel`` holding ``tensors`` (assigned, not copied; strict: every tensor
    and no other)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    arch, eod, vocab = hf_config.architecture(job.model), end_of_document(job), job.model.vocab_size
    if arch == hf_config.GPT2:
        cls, cfg = GPT2LMHeadModel, GPT2Config(**hf_config.gpt2_fields(job.model, vocab), architectures=[arch],
                                               bos_token_id=None, eos_token_id=eod, pad_token_id=None)
    else:
        cls, cfg = LlamaForCausalLM, LlamaConfig(**hf_config.llama_fields(job.model, vocab), architectures=[arch],
                                                 bos_token_id=None, eos_token_id=eod, pad_token_id=None)
    cfg.dtype = dtype
    with torch.device("meta"):
        model = cls(cfg)
    model.load_state_dict(tensors, strict=False, assign=True)
    if not job.model.untie_embeddings_and_output_weights:
        model.tie_weights()
    missing = sorted(n for n, p in model.named_parameters() if p.device.type == "meta")  # buffers: not saved
    if missing:
        raise ValueError(f"no weight for {missing[0]} (+{len(missing) - 1} more)")
    unexpected = sorted(set(tensors) - set(model.state_dict()))
    if unexpected:
        raise ValueError(f"{unexpected[0]} has no place in {type(model).__name__}")
    return model.eval()


def end_of_document(job: Any) -> Optional[int]:
    """The run tokenizer's end-of-document id (HF's ``eos_token_id``), None when it cannot be read here."""
    try:
        return int(get_tokenizer(job.data.tokenizer).eod)
    except Exception:  # a tokenizer file not on this machine: the export goes on without it
        return None


def job_padded_vocab(job: Any) -> int:
    """The vocabulary every layout of the run builds (TP1 here: the checkpoint's global embedding rows)."""
    m = job.model
    return padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, job.parallelism.tp)


def copy_tokenizer(job: Any, staging: Path) -> str:
    """The run's ``hf:`` tokenizer files into the export; a note when the run's tokenizer has none."""
    name = job.data.tokenizer
    if not name.startswith("hf:"):
        return f"note: data.tokenizer={name} has no Hugging Face tokenizer files; none were written"
    src = Path(name[3:]).expanduser()
    if not src.is_absolute() and job.cluster.data_root:
        src = Path(job.cluster.data_root) / src
    shutil.copyfile(src, staging / "tokenizer.json")
    (staging / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}, indent=1))
    return f"tokenizer: {src} -> tokenizer.json"


def export(src: Source, out: Path, dtype: str, max_shard_size: str, log=print) -> dict:
    """Write the HF directory for ``src`` at ``out`` (staged, then renamed); the record of what was written."""
    import torch
    from transformers import AutoModelForCausalLM

    from train import hf_bridge

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    t0 = time.monotonic()
    job, model = src.job, src.job.model
    staging = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        with hf_bridge.one_process():
            chunk = hf_bridge.load_checkpoint_model(job, src.path)
            t_load = time.monotonic() - t0
            tokens = probe_tokens(model)
            reference = hf_bridge.megatron_logits(chunk, tokens)
            full, padding = hf_bridge.trim_vocab(hf_bridge.full_state(chunk, model), model.vocab_size)
            tensors = hf_bridge.to_hf_for(full, model)
            del chunk, full
        torch_dtype = getattr(torch, dtype)
        tensors = {k: v.to(torch_dtype) for k, v in tensors.items()}
        hf = hf_model(job, tensors, dtype)
        hf.save_pretrained(str(staging), max_shard_size=max_shard_size)
        del hf, tensors
        vocab_line = save_vocab_padding(padding, staging, model.vocab_size, job_padded_vocab(job), torch_dtype)
        tokenizer_line = copy_tokenizer(job, staging)
        t_write = time.monotonic() - t0
        back = AutoModelForCausalLM.from_pretrained(str(staging), dtype=torch.float32).eval()
        with torch.no_grad():
            got = back(tokens).logits.float()
        check = compare_logits(reference, got)  # over the tokenizer's columns: all the HF model has
        check.update(tolerance=FP32_TOLERANCE if dtype == "float32" else None, probe_shape=list(tokens.shape))
        size = sum(p.stat().st_size for p in staging.iterdir() if p.is_file())
        record = {"run": str(src.run_dir), "run_name": job.run.name, "checkpoint": str(src.path), "step": src.step,
                  "trained_layout": job.layout_label, "dtype": dtype, "architecture": hf_config.architecture(model),
                  "bytes": size, "load_s": round(t_load, 3), "write_s": round(t_write, 3),
                  "seconds": round(time.monotonic() - t0, 3), "logits": check,
                  "skipped_newer": [[str(p), r] for p, r in src.skipped]}
        record.update(vocab_size=model.vocab_size, padded_vocab_size=job_padded_vocab(job))
        (staging / RECORD).write_text(json.dumps(record, indent=1))
        readable_by_group(staging, current_umask())
        if dtype == "float32" and not (check["max_abs_diff"] <= FP32_TOLERANCE and check["greedy_equal"]):
            raise Refused(EXIT_LOGITS, f"the written model does not reproduce {src.path}: max |logit difference| "
                                       f"{check['max_abs_diff']:.3g} (tolerance {FP32_TOLERANCE:g}), greedy tokens "
                                       f"{'equal' if check['greedy_equal'] else 'differ'}; nothing was kept")
        os.replace(staging, out) if not out.exists() else _into_empty(staging, out)
        log(vocab_line)
        log(tokenizer_line)
        return record
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def save_vocab_padding(padding: dict, staging: Path, vocab: int, padded: int, dtype: Any) -> str:
    """Write the padded rows the export cut (:data:`train.hf_bridge.VOCAB_PADDING_FILE`, for ``training.init_from``)
    and say what happened to the vocabulary in one line."""
    from safetensors.torch import save_file

    from train.hf_bridge import VOCAB_PADDING_FILE

    if not padding:
        return f"vocabulary: {vocab} token ids, no padding to trim"
    save_file({k: v.to(dtype).contiguous() for k, v in padding.items()}, str(staging / VOCAB_PADDING_FILE))
    return (f"vocabulary: trimmed to the tokenizer's {vocab} ids (config.json vocab_size {vocab}); the {padded - vocab} "
            f"padding rows of the trained {padded} are in {VOCAB_PADDING_FILE} for training.init_from")


def current_umask() -> int:
    """This process's umask (read by setting it and putting it back: the export is single-threaded here)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def readable_by_group(directory: Path, umask: int) -> None:
    """Give every file of the export the mode a plain ``open()`` gives (``0o666 & ~umask``: 0644 under the usual
    022, 0664 under a shared group's 002): the safetensors writer makes its files 0600, which teammates on a
    shared filesystem cannot read. A private umask (077) keeps them private."""
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)
_UNIT = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
         "GIB": 2**30, "TIB": 2**40}


def shard_bytes(text: str) -> Optional[int]:
    """``--max-shard-size`` in bytes (what transformers reads: ``5GB``, ``500MB``, ``2GiB``, a byte count), or None
    when it is not a size > 0."""
    m = _SIZE.match(str(text))
    if not m:
        return None
    n = int(float(m.group(1)) * _UNIT[(m.group(2) or "").upper()])
    return n if n > 0 else None


def _into_empty(staging: Path, out: Path) -> None:
    out.rmdir()  # checked empty before the export began
    os.replace(staging, out)


def main(argv: Optional[list] = None, env: Optional[dict] = None) -> int:
    env = dict(os.environ if env is None else env)
    parser = argparse.ArgumentParser(
        prog="python -m train.export", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="A run's newest verified checkpoint (or --step N), saved in any layout, as a Hugging Face "
                    "LlamaForCausalLM\nor GPT2LMHeadModel directory, checked by reloading it with transformers and "
                    "comparing logits.",
        epilog="exit codes: 0 written; 2 bad argument or input; 3 the written model does not reproduce the logits;\n"
               "5 no verified checkpoint; 7 storage error; 12 unsafe pickle; 13 checkpoint others can write\n"
               "docs/export.md: After training: export and evaluate")
    parser.add_argument("run_dir")
    parser.add_argument("--out", required=True, help="the Hugging Face directory to write (absent or empty)")
    parser.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: newest verified)")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="weights' dtype (default: the training's)")
    parser.add_argument("--max-shard-size", default="5GB", help="safetensors shard size (an index past one shard)")
    args = parser.parse_args(argv)
    try:
        run_dir = given_run_dir(args.run_dir)
    except RunDirError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if shard_bytes(args.max_shard_size) is None:  # checked before the load, not after it
        print(f"error: --max-shard-size {args.max_shard_size!r} is not a size > 0 (e.g. 5GB, 500MB or a byte count)",
              file=sys.stderr)
        return 2
    out = Path(args.out).expanduser().resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"error: --out {out} exists and is not an empty directory; an export never overwrites: give a new "
              f"directory", file=sys.stderr)
        return 2
    unwritable = unwritable_ancestor(out.parent)
    if unwritable:
        print(f"error: --out {out}: {unwritable}; nothing was loaded or written", file=sys.stderr)
        return policy.EXIT_STORAGE
    try:
        src = find_source(run_dir, args.step, env)
        for path, reason in src.skipped:
            print(f"WARNING: skipped the newer {path.name} ({reason}); exporting {src.path.name}", file=sys.stderr)
        dtype = args.dtype or hf_config.EXPORT_DTYPES.get(src.job.training.precision, "float32")
        print(f"exporting {src.path} (step {src.step}, trained {src.job.layout_label}) to {out} as "
              f"{hf_config.architecture(src.job.model)} in {dtype}", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        rec = export(src, out, dtype, args.max_shard_size)
    except Refused as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    except OSError as e:  # the disk filled, or the directory changed under the export: the staging is removed
        print(f"error: cannot write {out}: {e.strerror or e}{f' ({e.filename})' if e.filename else ''}; nothing was "
              f"kept", file=sys.stderr)
        return policy.EXIT_STORAGE
    lg = rec["logits"]
    print(f"wrote {out}: {rec['bytes'] / 1e6:.1f} MB in {rec['seconds']:.1f} s; transformers reloads it with "
          f"max |logit difference| {lg['max_abs_diff']:.2g} and {'the same' if lg['greedy_equal'] else 'DIFFERENT'} "
          f"greedy tokens on a {lg['probe_shape'][0]}x{lg['probe_shape'][1]} probe batch")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
