"""The on-disk format of a prepared dataset: index.json, shard files, and reading them back.

See the dataset spec: a 32-byte header then little-endian token ids per shard; index.json written canonically,
its sha256 is the dataset's identity. Readers memory-map shards, so memory does not grow with the dataset.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dilocod.data.errors import DataError
from dilocod.files import atomic_write, file_sha256

FORMAT = "dilocod-dataset"
VERSION = 1
INDEX_FILE = "index.json"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "eval")
DTYPES = {"uint16": 2, "uint32": 4}
UINT16_MAX_VOCAB = 65536

HEADER_SIZE = 32
_HEADER = struct.Struct("<8sIIQQ")  # magic, version, bytes per token, tokens, reserved
_MAGIC = b"DLCDTOK\0"
_SHARD_VERSION = 1
_BLOCK = 1 << 20
_HEX64 = re.compile(r"[0-9a-f]{64}")
_OPEN_SHARDS = 32  # memory maps a TokenStream keeps open (each holds a file descriptor)


@dataclass(frozen=True)
class ShardInfo:
    file: str
    tokens: int
    sha256: str
    bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "tokens": self.tokens, "sha256": self.sha256, "bytes": self.bytes}


@dataclass(frozen=True)
class SplitInfo:
    documents: int
    tokens: int
    text_bytes: int  # UTF-8 bytes of the documents' text: bits per byte = nats * tokens / text_bytes / ln 2
    shards: tuple[ShardInfo, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "documents": self.documents,
            "tokens": self.tokens,
            "text_bytes": self.text_bytes,
            "shards": [s.to_json() for s in self.shards],
        }


@dataclass(frozen=True)
class DatasetIndex:
    version: int
    tokenizer_sha256: str
    vocab_size: int
    eos_id: int
    dtype: str
    shard_tokens: int
    train: SplitInfo
    eval: SplitInfo
    raw: bytes  # the canonical index.json bytes

    @property
    def hash(self) -> str:
        """The dataset's identity: sha256 hex of the index.json bytes."""
        return hashlib.sha256(self.raw).hexdigest()

    def split(self, name: str) -> SplitInfo:
        if name == "train":
            return self.train
        if name == "eval":
            return self.eval
        raise ValueError(f"no split {name!r} (splits: {', '.join(SPLITS)})")

    def files(self) -> list[ShardInfo]:
        """Every shard of both splits, train first."""
        return [*self.train.shards, *self.eval.shards]


def shard_dtype(vocab_size: int) -> str:
    """uint16 while every id fits in it, else uint32."""
    return "uint16" if vocab_size <= UINT16_MAX_VOCAB else "uint32"


def shard_name(split: str, number: int) -> str:
    return f"{split}-{number:05d}.bin"


def index_bytes(obj: dict[str, Any]) -> bytes:
    """index.json as the spec writes it: sorted keys, no spaces, a final newline."""
    return (json.dumps(obj, sort_keys=True, separators=(",", ":")) + "\n").encode("utf-8")


def index_object(
    *,
    tokenizer_sha256: str,
    vocab_size: int,
    eos_id: int,
    shard_tokens: int,
    train: SplitInfo,
    eval: SplitInfo,
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer_sha256": tokenizer_sha256,
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "dtype": shard_dtype(vocab_size),
        "shard_tokens": shard_tokens,
        "splits": {"train": train.to_json(), "eval": eval.to_json()},
    }


# ---------------------------------------------------------------- parsing the index


def _field(obj: dict[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in obj:
        raise DataError(f"{where}: missing field {key!r}")
    value = obj[key]
    # bool is an int to Python, never to the index
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise DataError(f"{where}: field {key!r} must be {kind.__name__}, got {type(value).__name__}")
    return value


def _count(obj: dict[str, Any], key: str, where: str, minimum: int = 0) -> int:
    value: int = _field(obj, key, int, where)
    if value < minimum:
        raise DataError(f"{where}: field {key!r} must be >= {minimum}, got {value}")
    return value


def _parse_shards(
    split: str, items: list[Any], dtype: str, shard_tokens: int, where: str
) -> tuple[ShardInfo, ...]:
    shards: list[ShardInfo] = []
    for number, item in enumerate(items):
        at = f"{where}: {split} shard {number}"
        if not isinstance(item, dict) or set(item) != {"file", "tokens", "sha256", "bytes"}:
            raise DataError(f"{at}: must be an object with file, tokens, sha256 and bytes")
        info = ShardInfo(
            file=_field(item, "file", str, at),
            tokens=_count(item, "tokens", at, minimum=1),
            sha256=_field(item, "sha256", str, at),
            bytes=_count(item, "bytes", at),
        )
        if info.file != shard_name(split, number):
            raise DataError(f"{at}: file is {info.file!r}, expected {shard_name(split, number)!r}")
        if not _HEX64.fullmatch(info.sha256):
            raise DataError(f"{at}: sha256 is not 64 lowercase hex digits")
        last = number == len(items) - 1
        if info.tokens > shard_tokens or (not last and info.tokens != shard_tokens):
            raise DataError(
                f"{at}: {info.tokens} tokens, but shards hold {shard_tokens} (the last may hold fewer)"
            )
        if info.bytes != HEADER_SIZE + info.tokens * DTYPES[dtype]:
            raise DataError(f"{at}: {info.bytes} bytes does not fit {info.tokens} {dtype} tokens")
        shards.append(info)
    return tuple(shards)


def _parse_split(obj: Any, split: str, dtype: str, shard_tokens: int, where: str) -> SplitInfo:
    at = f"{where}: split {split!r}"
    if not isinstance(obj, dict):
        raise DataError(f"{at}: must be an object")
    items = _field(obj, "shards", list, at)
    info = SplitInfo(
        documents=_count(obj, "documents", at, minimum=1),
        tokens=_count(obj, "tokens", at, minimum=1),
        text_bytes=_count(obj, "text_bytes", at),
        shards=_parse_shards(split, items, dtype, shard_tokens, where),
    )
    if sum(s.tokens for s in info.shards) != info.tokens:
        raise DataError(
            f"{at}: its shards hold {sum(s.tokens for s in info.shards)} tokens, not {info.tokens}"
        )
    return info


def parse_index(raw: bytes, where: str = INDEX_FILE) -> DatasetIndex:
    """Parse and check index.json bytes; anything off is a one-line DataError naming ``where``."""
    try:
        obj = json.loads(raw)
    except ValueError as e:
        raise DataError(f"{where}: not valid JSON ({getattr(e, 'msg', e)})") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise DataError(f'{where}: not a dilocod dataset index (no "format": "{FORMAT}")')
    version = obj.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version != VERSION:
        raise DataError(
            f"{where}: index of another version ({version!r}; this dilocod reads version {VERSION})"
        )
    expected_keys = {
        "format",
        "version",
        "tokenizer_sha256",
        "vocab_size",
        "eos_id",
        "dtype",
        "shard_tokens",
        "splits",
    }
    if set(obj) != expected_keys:
        odd = sorted(set(obj) ^ expected_keys)
        raise DataError(f"{where}: unexpected or missing fields: {', '.join(odd)}")
    if raw != index_bytes(obj):
        raise DataError(f"{where}: not in canonical form (its hash would not identify the dataset)")
    tokenizer_sha256 = _field(obj, "tokenizer_sha256", str, where)
    if not _HEX64.fullmatch(tokenizer_sha256):
        raise DataError(f"{where}: tokenizer_sha256 is not 64 lowercase hex digits")
    vocab_size = _count(obj, "vocab_size", where, minimum=1)
    eos = _count(obj, "eos_id", where)
    if eos >= vocab_size:
        raise DataError(f"{where}: eos_id {eos} is outside the vocabulary of {vocab_size}")
    dtype = _field(obj, "dtype", str, where)
    if dtype != shard_dtype(vocab_size):
        raise DataError(
            f"{where}: dtype {dtype!r} is not {shard_dtype(vocab_size)!r} for {vocab_size} tokens"
        )
    shard_tokens = _count(obj, "shard_tokens", where, minimum=1)
    splits = _field(obj, "splits", dict, where)
    if set(splits) != set(SPLITS):
        raise DataError(f"{where}: splits must be exactly train and eval, got {', '.join(sorted(splits))}")
    return DatasetIndex(
        version=version,
        tokenizer_sha256=tokenizer_sha256,
        vocab_size=vocab_size,
        eos_id=eos,
        dtype=dtype,
        shard_tokens=shard_tokens,
        train=_parse_split(splits["train"], "train", dtype, shard_tokens, where),
        eval=_parse_split(splits["eval"], "eval", dtype, shard_tokens, where),
        raw=raw,
    )


def load_index(directory: Path) -> DatasetIndex:
    path = Path(directory) / INDEX_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(
            f"{path}: no such file (not a prepared dataset? see `dilocod data prepare`)"
        ) from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    return parse_index(raw, str(path))


# ---------------------------------------------------------------- shard files


def _le(dtype: str) -> np.dtype[Any]:
    if dtype not in DTYPES:
        raise ValueError(f"shard dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return np.dtype(dtype).newbyteorder("<")


def write_shard(path: Path, tokens: np.ndarray, dtype: str) -> ShardInfo:
    """Write ``tokens`` as a shard of ``dtype`` (atomically); its ShardInfo for the index."""
    path = Path(path)
    data = np.ascontiguousarray(tokens, dtype=_le(dtype))
    header = _HEADER.pack(_MAGIC, _SHARD_VERSION, data.itemsize, data.size, 0)
    digest = atomic_write(path, [header, data.data.cast("B")])
    return ShardInfo(file=path.name, tokens=int(data.size), sha256=digest, bytes=HEADER_SIZE + data.nbytes)


def _check_header(path: Path, dtype: str, expected_tokens: int | None) -> int:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER_SIZE)
    if len(head) < HEADER_SIZE:
        raise DataError(f"{path}: {size} bytes, too short for a shard header ({HEADER_SIZE} bytes)")
    magic, version, itemsize, count, _ = _HEADER.unpack(head)
    if magic != _MAGIC:
        raise DataError(f"{path}: not a dilocod token shard (bad magic {magic!r})")
    if version != _SHARD_VERSION:
        raise DataError(f"{path}: shard of another version ({version}; this dilocod reads {_SHARD_VERSION})")
    if itemsize != DTYPES[dtype]:
        raise DataError(
            f"{path}: {itemsize} bytes per token, but the index's dtype {dtype} has {DTYPES[dtype]}"
        )
    if HEADER_SIZE + count * itemsize != size:
        raise DataError(
            f"{path}: header says {count} tokens ({HEADER_SIZE + count * itemsize} bytes), file has {size} bytes (truncated?)"
        )
    if expected_tokens is not None and count != expected_tokens:
        raise DataError(f"{path}: {count} tokens, the index says {expected_tokens}")
    return int(count)


def open_shard(path: Path, dtype: str, expected_tokens: int | None = None) -> np.ndarray:
    """The tokens of a shard as a read-only memory map, after checking its header against the file."""
    path = Path(path)
    _le(dtype)
    try:
        count = _check_header(path, dtype, expected_tokens)
        if count == 0:
            return np.empty(0, dtype=_le(dtype))  # mmap cannot map zero bytes
        return np.memmap(path, dtype=_le(dtype), mode="r", offset=HEADER_SIZE, shape=(count,))
    except FileNotFoundError:
        raise DataError(f"{path}: no such shard file") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None


def verify_shard(path: Path, info: ShardInfo) -> None:
    """The file is the shard the index names: its size, then its sha256."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size != info.bytes:
            raise DataError(f"{path}: {size} bytes, the index says {info.bytes}")
        digest = file_sha256(path)
    except FileNotFoundError:
        raise DataError(f"{path}: no such shard file") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    if digest != info.sha256:
        raise DataError(f"{path}: sha256 {digest} does not match the index's {info.sha256}")


def verify_dataset(
    directory: Path, index: DatasetIndex | None = None, *, only: set[str] | None = None
) -> DatasetIndex:
    """Check tokenizer.json and every shard (or those named in `only`) against the index (hashes read
    every byte)."""
    directory = Path(directory)
    index = index if index is not None else load_index(directory)
    tokenizer = directory / TOKENIZER_FILE
    try:
        digest = file_sha256(tokenizer)
    except OSError as e:
        raise DataError(f"{tokenizer}: cannot read ({e.strerror or e})") from None
    if digest != index.tokenizer_sha256:
        raise DataError(f"{tokenizer}: sha256 {digest} does not match the index's {index.tokenizer_sha256}")
    for info in index.files():
        if only is None or info.file in only:
            verify_shard(directory / info.file, info)
    return index


# ---------------------------------------------------------------- reading a split


class TokenStream:
    """A split's token stream (the concatenation of its shards), read through memory maps opened on demand.

    Only the most recently used shards stay mapped, so neither memory nor open files grow with the dataset.
    """

    def __init__(self, directory: Path, index: DatasetIndex, split: str) -> None:
        self.directory = Path(directory)
        self.dtype = index.dtype
        self.shards = index.split(split).shards
        self._starts = np.cumsum([0, *(s.tokens for s in self.shards)], dtype=np.int64)
        self._open: OrderedDict[int, np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _shard(self, number: int) -> np.ndarray:
        if number in self._open:
            self._open.move_to_end(number)
            return self._open[number]
        info = self.shards[number]
        tokens = open_shard(self.directory / info.file, self.dtype, info.tokens)
        self._open[number] = tokens
        if len(self._open) > _OPEN_SHARDS:
            self._open.popitem(last=False)
        return tokens

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) as a fresh int64 array, across shard boundaries."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"tokens [{start}, {stop}) outside the stream of {len(self)}")
        out = np.empty(stop - start, dtype=np.int64)
        number = int(np.searchsorted(self._starts, start, side="right")) - 1
        at = start
        while at < stop:
            base = int(self._starts[number])
            end = min(stop, int(self._starts[number + 1]))
            out[at - start : end - start] = self._shard(number)[at - base : end - base]
            at = end
            number += 1
        return out
