"""Streaming safetensors reader and atomic writer (no torch needed).

Format: 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets}}, then the
raw little-endian tensor bytes. Reading memory-maps the file, so a tensor is materialised only when asked for:
host memory stays near one tensor. bfloat16 and float8 are read through ml_dtypes.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from unsloth_jax.errors import CheckpointNotFoundError, CorruptCheckpointError
from unsloth_jax.hf.file_modes import chmod_like_new

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
_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsFile:
    """A memory-mapped safetensors file. Use as a context manager; `get(name)` returns a read-only numpy view."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointNotFoundError(f"safetensors file not found: {self.path}")
        self._fh = open(self.path, "rb")
        size = os.fstat(self._fh.fileno()).st_size
        if size < 8:
            self._fh.close()
            raise CorruptCheckpointError(f"{self.path}: file is {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", self._fh.read(8))
        if n > min(size - 8, _MAX_HEADER):
            self._fh.close()
            raise CorruptCheckpointError(
                f"{self.path}: header length {n} exceeds the file size {size}; the file is truncated or not safetensors"
            )
        try:
            header = json.loads(self._fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            self._fh.close()
            raise CorruptCheckpointError(f"{self.path}: header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            self._fh.close()
            raise CorruptCheckpointError(f"{self.path}: header is not a JSON object")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._data_start = 8 + n
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            try:
                dtype = DTYPES[info["dtype"]]
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                self._fh.close()
                raise CorruptCheckpointError(f"{self.path}: bad header entry for tensor '{name}': {info!r}") from None
            expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if end - begin != expected or begin < 0 or self._data_start + end > size:
                self._fh.close()
                raise CorruptCheckpointError(
                    f"{self.path}: tensor '{name}' ({info['dtype']}{list(shape)}) has data_offsets {begin}..{end} "
                    f"that do not fit its shape or the file size {size}; the file is truncated or corrupt"
                )
            self._entries[name] = (dtype, shape, begin, end)
        self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ) if size > 0 else None

    def keys(self) -> list[str]:
        """Tensor names in file order (by data offset)."""
        return sorted(self._entries, key=lambda k: self._entries[k][2])

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def dtype(self, name: str) -> np.dtype:
        return self._entries[name][0]

    def get(self, name: str) -> np.ndarray:
        """The tensor as a numpy array viewing the mapped file (copy it before the file is closed)."""
        dtype, shape, begin, end = self._entries[name]
        if end == begin:
            return np.zeros(shape, dtype)
        start = self._data_start + begin
        return np.frombuffer(self._mm, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=start).reshape(shape)

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a numpy view still references the map; it is freed with the view
                pass
        self._fh.close()

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def checkpoint_files(model_dir: str | os.PathLike, prefix: str = "model") -> list[Path]:
    """The safetensors files of a checkpoint directory: `{prefix}.safetensors` or the shards its index names."""
    model_dir = Path(model_dir)
    single = model_dir / f"{prefix}.safetensors"
    index = model_dir / f"{prefix}.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CorruptCheckpointError(f"{index}: not a valid safetensors index ({e!r})") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (model_dir / f).is_file()]
        if missing:
            raise CheckpointNotFoundError(f"{index} names shard(s) that are missing: {', '.join(missing)}")
        return [model_dir / f for f in files]
    if single.is_file():
        return [single]
    found = sorted(p.name for p in model_dir.glob("*.safetensors"))
    hint = f" (found: {', '.join(found)})" if found else ""
    raise CheckpointNotFoundError(
        f"{model_dir}: no {prefix}.safetensors or {prefix}.safetensors.index.json{hint}. "
        "Only safetensors checkpoints are supported; convert .bin files with transformers' save_pretrained."
    )


def _atomic_write(path: Path, chunks: Iterator[bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        chmod_like_new(tmp)  # mkstemp makes it 0600
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                out.write(chunk)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_file(tensors: Mapping[str, np.ndarray], path: str | os.PathLike, metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` (name -> numpy array, bf16 via ml_dtypes) as one safetensors file, atomically."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    arrays = []
    for name in tensors:
        arr = np.ascontiguousarray(tensors[name])
        if arr.dtype not in _NAMES:
            raise TypeError(f"tensor '{name}': dtype {arr.dtype} cannot be stored in safetensors")
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # align the data section to 8 bytes, as the reference writer does

    def chunks() -> Iterator[bytes]:
        yield struct.pack("<Q", len(blob))
        yield blob
        for arr in arrays:
            yield arr.reshape(-1).view(np.uint8).tobytes()

    _atomic_write(Path(path), chunks())
