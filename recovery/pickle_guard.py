"""No code runs from a checkpoint: every pickle a resume would load is checked against an allow-list first.

A checkpoint directory is data that anyone who can write it can change, and its manifest does not stop
them: the manifest is an integrity check (a torn save, a flipped byte), not authentication, and a
writer can recompute its SHA-256 and sizes. Loading it unpickles several files:

* ``.metadata``: torch's distributed-checkpoint reader calls ``pickle.load`` on it (no restriction);
* the ``BYTE_IO`` items inside the ``*.distcp`` shards (Megatron-Core's sharded objects, a layer's
  ``_extra_state``): torch's default load planner calls ``torch.load(weights_only=False)`` on each;
* a record stored through a stream transform (``transform_descriptors``, e.g. ``stream.zstd/1``): torch's
  reader decodes it before unpickling, so the bytes on disk are not the bytes it unpickles. The ranks never
  write one, and a record that names one is refused without decoding it;
* ``common.pt`` (and any other ``*.pt``): ``torch.load`` with torch's default (``weights_only=True``
  since torch 2.6, unless ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set).

:func:`unsafe_pickles` reads each of them with an unpickler whose ``find_class`` admits only the
distributed-checkpoint metadata types, the tensor/storage rebuild helpers, dtypes and plain containers,
and which never calls what it finds: an admitted global is replaced by an inert stand-in that only
records its arguments, so even an admitted name executes nothing during the check. A pickle that needs
any other global (``builtins.exec``, ``os.system``, ``subprocess.Popen``, a class of some package) is
reported, with the file and the name; the resume refuses such a checkpoint
(:data:`recovery.policy.EXIT_UNSAFE_CHECKPOINT`) and quarantines it. Tensor records of the shards are
not read here (torch loads them with ``weights_only=True``).

The check runs before anything is loaded: on rank 0 in the start decision
(:func:`recovery.resume.plan_resume`), again on every rank right before the load
(:func:`train.megatron_ckpt.load`), and in the read-only inspector ``python -m recovery.resume``.

Standard library only: the login node checks checkpoints too.
"""
from __future__ import annotations

import _compat_pickle
import io
import os
import pickle
import pickletools
import struct
import zipfile
from pathlib import Path
from typing import Any, Iterator, Optional

__all__ = ["UnsafePickle", "check_pickle", "unsafe_pickles", "ALLOWED"]

_DCP = "torch.distributed.checkpoint"
_DTYPES = ("float32", "float16", "bfloat16", "float64", "float", "half", "double", "int64", "int32", "int16",
           "int8", "uint8", "uint16", "uint32", "uint64", "bool", "long", "int", "short", "complex64",
           "complex128", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
_STORAGES = ("UntypedStorage", "FloatStorage", "HalfStorage", "BFloat16Storage", "DoubleStorage", "LongStorage",
             "IntStorage", "ShortStorage", "CharStorage", "ByteStorage", "BoolStorage", "ComplexFloatStorage",
             "ComplexDoubleStorage")
# (module, name) pairs a checkpoint's pickles may name; nothing else is admitted
ALLOWED = frozenset(
    {(f"{_DCP}.metadata", n) for n in ("Metadata", "ChunkStorageMetadata", "TensorStorageMetadata",
                                        "BytesStorageMetadata", "TensorProperties", "MetadataIndex", "StorageMeta",
                                        "_MEM_FORMAT_ENCODING")}
    | {(f"{_DCP}.planner", n) for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "ReadItem",
                                         "LoadItemType", "LoadPlan")}
    | {(f"{_DCP}.filesystem", "_StorageInfo")}
    | {("torch", n) for n in _DTYPES + _STORAGES + ("Size", "device", "strided", "sparse_coo", "contiguous_format",
                                                      "channels_last", "preserve_format")}
    | {("torch.serialization", "_get_layout"), ("torch.storage", "UntypedStorage"),
       ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor"),
       ("torch._utils", "_rebuild_parameter"), ("torch._utils", "_rebuild_parameter_with_state"),
       ("torch.nn.parameter", "Parameter")}
    | {("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
       ("builtins", "complex"), ("_codecs", "encode"), ("builtins", "bytearray")}
    # StorageMeta.checkpoint_id: constructing a path only stores its parts
    | {("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}
)
_MAX_PICKLE = 1 << 30  # a pickle this large is not metadata: refused unread


class UnsafePickle(Exception):
    """A checkpoint file whose pickle names a global outside :data:`ALLOWED` (or is not a pickle at all)."""


class _Inert:
    """What an admitted global becomes during the check: accepts every call and state, runs nothing."""

    _qual: tuple = ("?", "?")

    def __new__(cls, *args: Any, **kwargs: Any) -> "_Inert":
        obj = object.__new__(cls)
        obj.__dict__["args"] = args
        obj.__dict__["state"] = None
        obj.__dict__["items"] = {}
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.__dict__["state"] = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.__dict__["items"][key] = value

    def append(self, value: Any) -> None:
        self.__dict__["items"][len(self.__dict__["items"])] = value

    def extend(self, values: Any) -> None:
        for v in values:
            self.append(v)

    def __hash__(self) -> int:
        return id(self)

    def field(self, name: str) -> Any:
        """A dataclass field from the recorded state (``{...}`` or ``(None, {slots})``), else None."""
        state = self.__dict__["state"]
        if isinstance(state, tuple) and len(state) == 2:
            merged: dict = {}
            for part in state:
                if isinstance(part, dict):
                    merged.update(part)
            state = merged
        return state.get(name) if isinstance(state, dict) else None


class _Checker(pickle.Unpickler):
    def __init__(self, stream: io.BytesIO, where: str) -> None:
        super().__init__(stream)
        self.where = where
        self._stand_ins: dict = {}

    def find_class(self, module: str, name: str) -> Any:
        # what the real unpickler resolves a Python 2 name to (fix_imports; torch.save writes protocol 2)
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        if (module, name) not in ALLOWED:
            raise UnsafePickle(f"{self.where} needs {module}.{name}, which is not a checkpoint data type")
        key = (module, name)
        if key not in self._stand_ins:
            self._stand_ins[key] = type(name, (_Inert,), {"_qual": key})
        return self._stand_ins[key]

    def persistent_load(self, pid: Any) -> Any:  # torch.save's storage records: data, never code
        return _Inert(pid)


def _admit(module: str, name: str, where: str) -> None:
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    elif module in _compat_pickle.IMPORT_MAPPING:
        module = _compat_pickle.IMPORT_MAPPING[module]
    if (module, name) not in ALLOWED:
        raise UnsafePickle(f"{where} needs {module}.{name}, which is not a checkpoint data type")


_STRING_OPS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING",
                         "STRING"})
_QUIET_OPS = frozenset({"PROTO", "FRAME", "PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE", "STOP"})


def _static_scan(data: bytes, where: str) -> None:
    """Every global the opcodes up to the first unreadable one could name (what a real unpickler would get to
    before failing at the same place), judged without running anything; an unresolvable name is unsafe."""
    top: list = []  # what the last opcodes pushed: a string, or None for anything else
    memo: dict = {}
    try:
        for op, arg, _pos in pickletools.genops(data):
            kind = op.name
            if kind in ("GLOBAL", "INST"):
                module, _, name = str(arg).partition(" ")
                _admit(module, name, where)
                top.append(None)
            elif kind == "STACK_GLOBAL":
                if len(top) < 2 or not isinstance(top[-1], str) or not isinstance(top[-2], str):
                    raise UnsafePickle(f"{where} names a global that cannot be resolved without running it")
                _admit(top[-2], top[-1], where)
                top[-2:] = [None]
            elif kind in _STRING_OPS:
                top.append(arg if isinstance(arg, str) else None)
            elif kind in ("GET", "BINGET", "LONG_BINGET"):
                top.append(memo.get(arg))
            elif kind in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg] = top[-1] if top else None
            elif kind == "MEMOIZE":
                memo[len(memo)] = top[-1] if top else None
            elif kind not in _QUIET_OPS:
                top.append(None)
    except UnsafePickle:
        raise
    except Exception:  # an unreadable opcode: the real unpickler stops here too
        return


def check_pickle(data: bytes, where: str, *, every: bool = False) -> Any:
    """Unpickle ``data`` with the allow-list and inert stand-ins; raises :class:`UnsafePickle`.

    ``every``: ``data`` may hold several pickles one after another (torch's legacy format: magic number,
    protocol, system info, the object, its storage keys, then raw bytes); each is checked, as a loader reads
    them all. A stream that is not a readable pickle (truncated, random bytes) is no code either: it returns
    after :func:`_static_scan` judged every global up to the point where the real unpickler fails too (the
    load then fails as an ordinary load error). Returns the first pickle's (inert) object.
    """
    stream = io.BytesIO(data)
    first, n = None, 0
    while stream.tell() < len(data) and n < (8 if every else 1):
        start = stream.tell()
        try:
            obj = _Checker(stream, where).load()
        except UnsafePickle:
            raise
        except RecursionError:
            raise UnsafePickle(f"{where} is nested too deeply to be checkpoint metadata") from None
        except Exception:  # truncated, not a pickle, an opcode applied to the wrong thing
            _static_scan(data[start:], where)
            break
        first = obj if n == 0 else first
        n += 1
    return first


def _stored_member(blob: bytes, info: zipfile.ZipInfo) -> bytes:
    """A stored (uncompressed) zip member's bytes, read from its local header (torch writes no CRC32 here)."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"member {info.filename} is compressed")
    off = info.header_offset
    sig, *_rest = struct.unpack_from("<4s22xHH", blob, off)
    if sig != b"PK\x03\x04":
        raise ValueError(f"member {info.filename} has no local header")
    name_len, extra_len = struct.unpack_from("<HH", blob, off + 26)
    start = off + 30 + name_len + extra_len
    return blob[start:start + info.compress_size]


def check_torch_save(blob: bytes, where: str) -> None:
    """A ``torch.save`` payload (zip with ``*/data.pkl``, or a legacy bare pickle): its pickle must pass."""
    if blob[:4] != b"PK\x03\x04":
        check_pickle(blob, where, every=True)  # the legacy format: several pickles, then raw bytes
        return
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as z:
            pkls = [i for i in z.infolist() if i.filename.endswith(".pkl")]
            if not pkls:
                raise UnsafePickle(f"{where} holds no data.pkl")
            for info in pkls:
                check_pickle(_stored_member(blob, info), f"{where}:{info.filename}")
    except (zipfile.BadZipFile, ValueError, struct.error) as e:
        raise UnsafePickle(f"{where} is not a readable torch.save archive ({e})") from None


def _read(path: Path) -> bytes:
    if path.stat().st_size > _MAX_PICKLE:
        raise UnsafePickle(f"{path.name} is {path.stat().st_size} bytes: too large for checkpoint metadata")
    return path.read_bytes()


def _byte_items(meta: Any) -> Iterator[tuple[str, int, int]]:
    """(relative path, offset, length) of every BYTE_IO record the metadata lists."""
    sdm = meta.field("state_dict_metadata") if isinstance(meta, _Inert) else None
    storage = meta.field("storage_data") if isinstance(meta, _Inert) else None
    if not isinstance(sdm, dict) or not isinstance(storage, dict):
        return  # not a Metadata record: no record to check (torch's reader fails on it as on any bad file)
    byte_fqns = {k for k, v in sdm.items()
                 if isinstance(v, _Inert) and v._qual == (f"{_DCP}.metadata", "BytesStorageMetadata")}
    for index, info in storage.items():
        fqn = index.field("fqn") if isinstance(index, _Inert) else None
        if isinstance(info, _Inert) and info.field("transform_descriptors"):
            # torch's reader would first undo these transforms (stream.zstd/1, ...) and then unpickle what comes
            # out: bytes this check never saw. The ranks never write a transform, so none is read.
            raise UnsafePickle(f".metadata: the record of {fqn!r} is stored through a transform "
                               f"({info.field('transform_descriptors')!r}), which a checkpoint of this run never uses")
        if fqn not in byte_fqns:
            continue
        rel = info.field("relative_path") if isinstance(info, _Inert) else None
        off, length = (info.field("offset"), info.field("length")) if isinstance(info, _Inert) else (None, None)
        if not isinstance(rel, str) or not isinstance(off, int) or not isinstance(length, int):
            raise UnsafePickle(f".metadata: the storage record of {fqn!r} is malformed")
        yield rel, off, length


def unsafe_pickles(ckpt: Path) -> Optional[str]:
    """Why a resume must not load checkpoint directory ``ckpt`` (its first unsafe pickle), or None.

    Checks ``.metadata``, every ``BYTE_IO`` record it lists in the shards, and every ``*.pt``.
    Raises OSError when a file cannot be read at all (a storage question, not this check's).
    """
    ckpt = Path(ckpt)
    try:
        names = sorted(os.listdir(ckpt))
        if ".metadata" in names:
            meta = check_pickle(_read(ckpt / ".metadata"), ".metadata")
            for rel, off, length in _byte_items(meta):
                target = (ckpt / rel).resolve()
                if target.parent != ckpt.resolve():
                    raise UnsafePickle(f".metadata points a record at {rel!r}, outside the checkpoint")
                if off < 0 or length < 0 or length > _MAX_PICKLE or off + length > target.stat().st_size:
                    raise UnsafePickle(f".metadata: a record of {rel} lies outside the file")
                with open(target, "rb") as f:  # only the record: a shard can be many GB
                    f.seek(off)
                    record = f.read(length)
                check_torch_save(record, f"{rel}@{off}")
        for name in names:
            if name.endswith(".pt"):
                check_torch_save(_read(ckpt / name), name)
    except UnsafePickle as e:
        return str(e)
    return None
