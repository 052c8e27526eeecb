"""Lazy reading of an HF checkpoint directory: `config.json` plus `model.safetensors` or sharded
`model.safetensors.index.json` (its `weight_map` names the shard holding each tensor).

The safetensors file format is three parts: an 8-byte little-endian header length N, N bytes of JSON
(`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`), then the raw bytes
of every tensor. This module parses the header itself and memory-maps the shard, so:

- listing names, shapes and dtypes reads only the headers (what `jhybrid inspect` needs);
- each tensor is read on demand as a numpy view of the mapped file;
- bfloat16 (and float8) work without torch: the bytes are viewed as `ml_dtypes` types. `safe_open(...,
  framework="numpy")` can only read bf16 when `ml_dtypes` happens to be imported, and older safetensors
  releases refuse it outright, so it is not used here.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import struct
from typing import Any, Iterator

import ml_dtypes
import numpy as np

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype tag -> numpy dtype.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}

_MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its shard file, shape, dtype and byte range inside the data section."""

    file: str
    shape: tuple[int, ...]
    dtype: np.dtype
    begin: int  # absolute byte offset in the file
    end: int


def read_header(path: str) -> dict[str, TensorInfo]:
    """Parses one `.safetensors` file's header (no tensor data is read).

    Raises:
      ValueError: the file is truncated, its header is not JSON, or a tensor has an unknown dtype or an
        inconsistent byte range.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path}: not a safetensors file (only {size} bytes)")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > min(_MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{path}: not a safetensors file ({header_len=} bytes does not fit in {size=})")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: safetensors header is not valid JSON ({e})") from None
    data_start = 8 + header_len
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tag = entry.get("dtype")
        if tag not in DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {tag!r}; supported: {sorted(DTYPES)}")
        dtype = DTYPES[tag]
        shape = tuple(int(n) for n in entry["shape"])
        begin, end = (int(x) for x in entry["data_offsets"])
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if end - begin != expected or data_start + end > size:
            raise ValueError(
                f"{path}: tensor {name!r} ({tag}, shape {shape}) has byte range [{begin}, {end}) "
                f"but needs {expected} bytes within a {size}-byte file"
            )
        out[name] = TensorInfo(path, shape, dtype, data_start + begin, data_start + end)
    return out


class SafetensorsCheckpoint:
    """An HF checkpoint directory, read lazily. Use as a context manager (closes the memory maps).

    Attributes:
      path: the directory.
      config: the parsed `config.json`.
      tensors: `{on-disk name: TensorInfo}` across all shards.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        config_path = os.path.join(self.path, "config.json")
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"{self.path}: no config.json; expected an HF checkpoint directory")
        with open(config_path) as f:
            self.config: dict[str, Any] = json.load(f)
        self.tensors = self._read_index()
        self._maps: dict[str, mmap.mmap] = {}

    def _read_index(self) -> dict[str, TensorInfo]:
        index_path = os.path.join(self.path, INDEX_FILE)
        single_path = os.path.join(self.path, SINGLE_FILE)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
            tensors: dict[str, TensorInfo] = {}
            for shard in sorted(set(weight_map.values())):
                shard_path = os.path.join(self.path, shard)
                if not os.path.isfile(shard_path):
                    raise FileNotFoundError(f"{index_path} names shard {shard!r}, which does not exist")
                for name, info in read_header(shard_path).items():
                    if weight_map.get(name, shard) != shard:  # a stale duplicate; the index decides
                        continue
                    tensors[name] = info
            missing = sorted(set(weight_map) - set(tensors))
            if missing:
                raise ValueError(f"{INDEX_FILE} lists tensors that no shard holds: {missing[:5]}")
            return tensors
        if os.path.isfile(single_path):
            return read_header(single_path)
        raise FileNotFoundError(f"{self.path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")

    def names(self) -> list[str]:
        return sorted(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def dtype(self, name: str) -> np.dtype:
        return self.tensors[name].dtype

    def read(self, name: str) -> np.ndarray:
        """The tensor as a read-only numpy view of the mapped file (copy it to keep it past `close`)."""
        info = self.tensors[name]
        buf = self._maps.get(info.file)
        if buf is None:
            with open(info.file, "rb") as f:
                buf = self._maps[info.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        count = (info.end - info.begin) // info.dtype.itemsize
        return np.frombuffer(buf, dtype=info.dtype, count=count, offset=info.begin).reshape(info.shape)

    def close(self) -> None:
        maps, self._maps = self._maps, {}
        for m in maps.values():
            try:
                m.close()
            except BufferError:  # a caller still holds a view; the map closes when it is collected
                pass

    def __enter__(self) -> "SafetensorsCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
