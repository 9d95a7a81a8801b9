"""Read Hugging Face ``*.safetensors`` checkpoints tensor by tensor, and stream-write one.

Reading uses ``safetensors.safe_open`` (an mmap of each file), so iterating a checkpoint never holds
more than one tensor in memory beyond the page cache. A sharded checkpoint is described by
``model.safetensors.index.json`` (``{"weight_map": {name: shard_file}}``); an unsharded one is a
single ``model.safetensors``.

Writing (:func:`write_safetensors_streaming`) lays out the file from a list of (name, dtype, shape)
specs first and then appends each tensor's bytes as it is produced, so converting a GGUF file never
holds the whole float32 state dict in memory.

File format: https://github.com/huggingface/safetensors#format (8-byte little-endian header length,
a JSON header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``
padded with spaces to a multiple of 8 bytes, then the raw little-endian tensor bytes).
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

if TYPE_CHECKING:   # torch loads where tensors are read or written: finding the files needs none
    import torch

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
SAFETENSORS_SINGLE_NAME = "model.safetensors"

# torch dtype name -> safetensors dtype tag (the ones a checkpoint for this engine can hold).
_SAFETENSORS_DTYPE = {
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float64": "F64",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


def list_safetensors_files(folder: str) -> list[str]:
    """The ``.safetensors`` files holding a checkpoint's weights, in load order.

    Args:
        folder: a Hugging Face model folder.
    Returns:
        Absolute-or-folder-relative paths: the shards named by ``model.safetensors.index.json`` (in
        sorted order, each once) when the index exists, else every ``*.safetensors`` file in the
        folder (sorted), which covers ``model.safetensors`` and index-less shards.
    Raises:
        ValueError: if the folder has no safetensors weights, or the index names a missing shard.
    """
    index_path = os.path.join(folder, SAFETENSORS_INDEX_NAME)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path} has no 'weight_map' entries")
        shards = sorted(set(weight_map.values()))
        paths = [os.path.join(folder, shard) for shard in shards]
        missing = [p for p in paths if not os.path.isfile(p)]
        if missing:
            raise ValueError(f"{index_path} names shard(s) that do not exist: {missing}")
        return paths
    paths = sorted(
        os.path.join(folder, name) for name in os.listdir(folder) if name.endswith(".safetensors"))
    if not paths:
        raise ValueError(
            f"model folder {folder!r} has no *.safetensors weights (nor {SAFETENSORS_INDEX_NAME}); "
            "only safetensors checkpoints are supported")
    return paths


def iterate_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of a (possibly sharded) safetensors checkpoint, under its stored name.

    Tensors keep the dtype and shape stored in the file (e.g. float32 ``[vocab_size, hidden_size]``
    for ``model.embed_tokens.weight``); they are mmap-backed CPU tensors, so copy or cast them
    before the file is deleted. Within a shard, names come in the file's order.

    Args:
        folder: a Hugging Face model folder (see :func:`list_safetensors_files`).
    Raises:
        ValueError: if the folder has no safetensors weights, or a name appears in two shards.
    """
    yield from _iterate_shards(folder, lambda f, name: f.get_tensor(name))


def iterate_safetensors_slices(folder: str) -> Iterator[tuple[str, Any]]:
    """Yield (name, slice) for every tensor of a (possibly sharded) safetensors checkpoint, reading
    nothing yet: ``slice.get_shape()`` gives the shape, ``slice[a:b]`` / ``slice[:, a:b]`` reads only
    those bytes from the mmap'd file (each tensor-parallel rank reads its shard).

    Raises:
        ValueError: as :func:`iterate_safetensors`.
    """
    yield from _iterate_shards(folder, lambda f, name: f.get_slice(name))


def _iterate_shards(folder: str, read: Callable[[Any, str], Any]) -> Iterator[tuple[str, Any]]:
    """(name, ``read(open_file, name)``) over every shard, each name once.

    Raises:
        ValueError: if the folder has no safetensors weights, or a name appears in two shards.
    """
    seen: set[str] = set()
    for path in list_safetensors_files(folder):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in seen:
                    raise ValueError(f"tensor {name!r} appears in more than one shard ({path})")
                seen.add(name)
                yield name, read(f, name)


@dataclass(frozen=True)
class TensorSpec:
    """What :func:`write_safetensors_streaming` needs to lay out one tensor before its bytes exist.

    Attributes:
        name: the tensor's name in the file.
        dtype: its torch dtype (a key of the safetensors dtype table: float32, bfloat16, ...).
        shape: its shape.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * self.dtype.itemsize


def write_safetensors_streaming(
    path: str,
    specs: Sequence[TensorSpec],
    tensors: Iterable[torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> int:
    """Write a safetensors file whose tensors are produced one at a time.

    The header is computed from ``specs``; then each tensor from ``tensors`` (in the same order as
    ``specs``) is checked against its spec and appended. Readers (``safe_open``,
    ``safetensors.torch.load_file``, transformers) read the result like any ``save_file`` output.

    Args:
        path: the file to create (overwritten if it exists).
        specs: name, dtype and shape of every tensor, in write order; names must be unique.
        tensors: the tensors, in the order of ``specs``, on any device (they are copied to the CPU).
        metadata: string->string ``__metadata__``; defaults to ``{"format": "pt"}``.
    Returns:
        Bytes written.
    Raises:
        ValueError: on duplicate names, a tensor whose dtype/shape differs from its spec, an
            unsupported dtype, or fewer/more tensors than specs.
    """
    import torch

    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for spec in specs:
        if spec.name in header:
            raise ValueError(f"duplicate tensor name {spec.name!r} in safetensors specs")
        dtype_name = str(spec.dtype).removeprefix("torch.")
        if dtype_name not in _SAFETENSORS_DTYPE:
            raise ValueError(f"dtype {spec.dtype} of {spec.name!r} cannot be written to safetensors")
        header[spec.name] = {
            "dtype": _SAFETENSORS_DTYPE[dtype_name],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)  # the data section starts 8-byte aligned

    written = 0
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        iterator = iter(tensors)
        for spec in specs:
            try:
                tensor = next(iterator)
            except StopIteration:
                raise ValueError(
                    f"got {written} tensors for {len(specs)} specs; missing {spec.name!r}") from None
            if tensor.dtype != spec.dtype or tuple(tensor.shape) != tuple(spec.shape):
                raise ValueError(
                    f"tensor {spec.name!r} is {tensor.dtype} {tuple(tensor.shape)}, "
                    f"but its spec says {spec.dtype} {tuple(spec.shape)}")
            data = tensor.detach().to("cpu").contiguous()
            # Raw bytes, little-endian as on every platform torch supports; the uint8 view sidesteps
            # numpy's missing bfloat16 and the memoryview avoids a copy.
            f.write(data.reshape(-1).view(torch.uint8).numpy().data)
            written += 1
        if next(iterator, None) is not None:
            raise ValueError(f"got more tensors than the {len(specs)} specs")
    return 8 + len(header_bytes) + offset
