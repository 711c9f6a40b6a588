"""The tokenizer named by ``data.tokenizer``: ``byte`` | ``hf:<tokenizer.json>`` | ``sentencepiece:<model>`` |
``tiktoken:<bpe file>``.

Preprocessing (:mod:`launch.preprocess`), the job check (vocabulary size against ``model.vocab_size``)
and the ranks (the EOD id Megatron's GPT dataset needs) all load it through :func:`get_tokenizer`.
Each has the attributes Megatron-Core's dataset reads (``vocab_size``, ``eod``,
``unique_identifiers``; no ``pad``, so Megatron uses its own pad id) and imports neither torch nor
megatron. The vocabulary size is the tokenizer's (largest id + 1); the model pads it by the one
rule of :mod:`launch.vocab`.

* ``byte``: UTF-8 bytes plus EOD (257 tokens), offline, no files: tests and the demo.
* ``hf:``: a Hugging Face ``tokenizer.json`` read by the ``tokenizers`` package. EOD is the
  ``eos_token`` of a ``tokenizer_config.json`` beside it, else the first of :data:`EOD_NAMES` in the
  vocabulary.
* ``sentencepiece:``: a ``.model`` file (``pip install sentencepiece``); EOD is its ``eos_id``.
* ``tiktoken:``: a ``.tiktoken`` BPE ranks file (``pip install tiktoken``), split with cl100k's
  pattern; EOD is ``<|endoftext|>``, appended after the ranks (id = number of ranks).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence

KINDS = ("byte", "hf", "sentencepiece", "tiktoken")
EOD_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<eod>", "<|eod|>")
CL100K_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|"""
                  r"""\s++$|\s*[\r\n]|\s+(?!\S)|\s""")


class TokenizerError(ValueError):
    """``data.tokenizer`` cannot be loaded; the message is one line naming the field, the cause and the fix.
    ``package`` is set when the cause is a Python package missing here (not a file)."""

    def __init__(self, message: str, package: str = "") -> None:
        super().__init__(message)
        self.package = package


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes are the tokens; ``eod`` (256) ends each document."""

    eod: int = 256

    @property
    def vocab_size(self) -> int:
        return self.eod + 1

    @property
    def unique_identifiers(self) -> Dict[str, object]:
        """Megatron's dataset hashes this into its index-cache key."""
        return {"class": type(self).__name__, "eod": self.eod}

    @property
    def vocab(self) -> Dict[str, int]:
        return {**{chr(i): i for i in range(256)}, "<eod>": self.eod}

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return {v: k for k, v in self.vocab.items()}

    def tokenize(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class _FileTokenizer:
    """Common part of the file-based tokenizers: ``name`` as written, ``vocab_size``, ``eod``."""

    name: str
    vocab_size: int
    eod: int

    @property
    def unique_identifiers(self) -> Dict[str, object]:
        return {"class": type(self).__name__, "name": self.name, "vocab_size": self.vocab_size, "eod": self.eod}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, vocab_size={self.vocab_size}, eod={self.eod})"


class HFTokenizer(_FileTokenizer):
    def __init__(self, name: str, path: str) -> None:
        tokenizers = _import(name, "tokenizers", "pip install tokenizers")
        self.name = name
        self._tok = tokenizers.Tokenizer.from_file(path)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        if not vocab:
            raise TokenizerError(f"data.tokenizer={name!r}: {path} has an empty vocabulary")
        self.vocab_size = max(vocab.values()) + 1
        self.eod = _hf_eod(name, path, vocab)

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _hf_eod(name: str, path: str, vocab: Dict[str, int]) -> int:
    config = os.path.join(os.path.dirname(path), "tokenizer_config.json")
    if os.path.exists(config):
        with open(config, encoding="utf-8") as f:
            eos: Any = json.load(f).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and eos in vocab:
            return vocab[eos]
    for token in EOD_NAMES:
        if token in vocab:
            return vocab[token]
    raise TokenizerError(f"data.tokenizer={name!r}: no end-of-document token: no eos_token in {config} and none of "
                         f"{', '.join(EOD_NAMES)} in the vocabulary; add one as a special token")


class SentencePieceTokenizer(_FileTokenizer):
    def __init__(self, name: str, path: str) -> None:
        spm = _import(name, "sentencepiece", "pip install sentencepiece, or slurmtron[data]")
        self.name = name
        self._sp = spm.SentencePieceProcessor(model_file=path)
        self.vocab_size = int(self._sp.get_piece_size())
        self.eod = int(self._sp.eos_id())
        if self.eod < 0:
            raise TokenizerError(f"data.tokenizer={name!r}: the model has no eos piece (eos_id = -1); "
                                 "train it with --eos_id=2 (SentencePiece's default)")

    def tokenize(self, text: str) -> List[int]:
        return list(self._sp.encode(text, out_type=int))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


class TiktokenTokenizer(_FileTokenizer):
    EOD_TOKEN = "<|endoftext|>"

    def __init__(self, name: str, path: str) -> None:
        tiktoken = _import(name, "tiktoken", "pip install tiktoken, or slurmtron[data]")
        from tiktoken.load import load_tiktoken_bpe

        self.name = name
        try:
            ranks = load_tiktoken_bpe(path)
        except (ValueError, IndexError) as e:
            raise TokenizerError(f"data.tokenizer={name!r}: {path} is not a tiktoken BPE file "
                                 f"('<base64 token> <rank>' lines): {e}") from None
        self.eod = max(ranks.values()) + 1
        self.vocab_size = self.eod + 1
        self._enc = tiktoken.Encoding(name=os.path.basename(path), pat_str=CL100K_PATTERN, mergeable_ranks=ranks,
                                      special_tokens={self.EOD_TOKEN: self.eod})

    def tokenize(self, text: str) -> List[int]:
        return self._enc.encode_ordinary(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._enc.decode([int(i) for i in ids])


def _import(name: str, module: str, fix: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise TokenizerError(f"data.tokenizer={name!r} needs the {module!r} package, which is not installed "
                             f"here ({fix})", package=module) from None


_FILE_KINDS = {"hf": HFTokenizer, "sentencepiece": SentencePieceTokenizer, "tiktoken": TiktokenTokenizer}


def under_root(name: str, data_root: str = "") -> str:
    """``data.tokenizer`` with a relative file path taken under ``cluster.data_root``, as relative data prefixes are
    (:mod:`launch.blend`), so the login node and every rank read the same file whatever their working directory.
    ``byte``, absolute paths and an empty root are unchanged."""
    kind, sep, path = name.partition(":")
    if not sep or kind not in _FILE_KINDS or not path or not data_root or os.path.isabs(path):
        return name
    return f"{kind}:{os.path.join(data_root, path)}"


_FILE_NAMES = {"hf": "tokenizer.json", "sentencepiece": ".model", "tiktoken": ".tiktoken"}


def get_tokenizer(name: str) -> Any:
    """The tokenizer named by ``data.tokenizer``; raises :class:`TokenizerError` with one line."""
    if name == "byte":
        return ByteTokenizer()
    kind, sep, path = name.partition(":")
    if not sep or kind not in _FILE_KINDS or not path:
        raise TokenizerError(f"data.tokenizer={name!r}: expected byte | hf:<tokenizer.json> | "
                             "sentencepiece:<file.model> | tiktoken:<file.tiktoken>")
    if os.path.isdir(path):
        inside = os.path.join(path, "tokenizer.json") if kind == "hf" else ""
        hint = f"; did you mean {kind}:{inside}?" if inside and os.path.isfile(inside) else \
            f"; name the {_FILE_NAMES[kind]} file itself"
        raise TokenizerError(f"data.tokenizer={name!r}: {path} is a directory, not a tokenizer file{hint}")
    if not os.path.isfile(path):
        raise TokenizerError(f"data.tokenizer={name!r}: {path} does not exist (checked on this machine)")
    try:
        return _FILE_KINDS[kind](name, path)
    except TokenizerError:
        raise
    except Exception as e:  # the libraries raise their own types for unreadable files
        raise TokenizerError(f"data.tokenizer={name!r}: {path} could not be read as a {kind} tokenizer: "
                             f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
