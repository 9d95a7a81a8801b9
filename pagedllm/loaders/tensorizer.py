"""CoreWeave's tensorizer format (vLLM's ``load_format="tensorizer"``): a rank's weights ↔ one
``.tensors`` file (local, ``s3://`` or ``http(s)://``), optionally encrypted with libsodium.

What a rank writes is its model *as loaded, before the kernel plan packs it*
(``sharded_state.rank_state_dict``: every parameter, a tied weight once, and the persistent
buffers, under the model's own names, this rank's tensor-parallel slices, in the engine's dtype),
plus vLLM's marker tensor ``.vllm_tensorized_marker``. Loading copies the tensors into a freshly
built model and the usual packing follows. A file without the marker (a Hugging Face model
serialized by tensorizer itself) goes through the model's ``load_weights`` under HF names, as
vLLM's non-vLLM path. Needs the ``tensorizer`` extra (``pip install 'pagedllm[tensorizer]'``).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
from torch import nn

from pagedllm.loaders.sharded_state import copy_state
from pagedllm.loaders.tensorizer_config import TensorizerConfig

logger = logging.getLogger(__name__)

VLLM_TENSORIZED_MARKER = ".vllm_tensorized_marker"   # vLLM's: a model serialized by the engine
# The model folder's files not copied beside the tensors (vLLM's ignore list, plus ours).
_ARTIFACT_SKIP_SUFFIXES = (".pt", ".safetensors", ".bin", ".cache", ".gitattributes", ".md", ".gguf",
                           ".tensors", ".safetensors.index.json", "pagedllm_gguf.json")
_REMOTE_SCHEMES = ("s3", "http", "https")


def import_tensorizer():
    """The ``tensorizer`` module.

    Raises:
        ImportError: tensorizer is not installed (naming the ``tensorizer`` extra).
    """
    try:
        import tensorizer
    except ImportError as e:
        raise ImportError("load_format='tensorizer' needs CoreWeave's tensorizer package: "
                          "pip install 'pagedllm[tensorizer]' (the tensorizer extra)") from e
    return tensorizer


def _stream_kwargs(config: TensorizerConfig) -> dict[str, Any]:
    return {"s3_access_key_id": config.s3_access_key_id, "s3_secret_access_key": config.s3_secret_access_key,
            "s3_endpoint": config.s3_endpoint, **config.stream_kwargs}


def _open(uri: str, mode: str, config: TensorizerConfig):
    from tensorizer.stream_io import open_stream

    return open_stream(uri, mode=mode, **_stream_kwargs(config))


def is_remote(uri: str) -> bool:
    """Whether ``uri`` is an ``s3://`` / ``http(s)://`` URI rather than a local path."""
    return uri.split("://", 1)[0].lower() in _REMOTE_SCHEMES and "://" in uri


def check_tensorizer_files(config: TensorizerConfig, tensor_parallel_size: int) -> None:
    """Check, before any worker starts, that every rank's local file exists (remote URIs are
    left to the reader).

    Raises:
        ValueError: a local rank file that does not exist (naming ``tensorizer_uri``).
    """
    for rank in range(tensor_parallel_size):
        uri = config.rank_uri(rank)
        if not is_remote(uri) and not os.path.isfile(uri):
            raise ValueError(f"tensorizer_uri {uri!r} (tp rank {rank}) does not exist: serialize the model first "
                             "(tensorize_vllm_model, examples/features/tensorize_vllm_model.py serialize)")


def write_random_key(config: TensorizerConfig) -> None:
    """Write a fresh random libsodium key (tensorizer's ``EncryptionParams.random()``) to
    ``config.encryption_keyfile``, before the ranks serialize with it.

    Raises:
        ImportError: tensorizer, or its libsodium binding, is missing.
    """
    import_tensorizer()
    from tensorizer import EncryptionParams

    with _open(config.encryption_keyfile, "wb+", config) as stream:
        stream.write(EncryptionParams.random().key)


def _read_key(config: TensorizerConfig) -> bytes:
    with _open(config.encryption_keyfile, "rb", config) as stream:
        return stream.read()


def save_tensorized(state: dict[str, torch.Tensor], config: TensorizerConfig, tp_rank: int) -> str:
    """Write one rank's ``state`` (``sharded_state.rank_state_dict(model)``) and vLLM's marker to
    ``config.rank_uri(tp_rank)`` with tensorizer's ``TensorSerializer``, encrypted with the key in
    ``config.encryption_keyfile`` when set.

    Returns:
        The URI written.
    Raises:
        ImportError: tensorizer is missing.
        OSError: the destination cannot be written.
    """
    import_tensorizer()
    from tensorizer import EncryptionParams, TensorSerializer

    encryption = EncryptionParams(key=_read_key(config)) if config.encryption_keyfile else None
    uri = config.rank_uri(tp_rank)
    if not is_remote(uri):
        os.makedirs(os.path.dirname(os.path.abspath(uri)), exist_ok=True)
    tensors = {name: t.detach().to("cpu") for name, t in state.items()}
    tensors[VLLM_TENSORIZED_MARKER] = torch.ones(1, dtype=torch.int64)
    t0 = time.perf_counter()
    with _open(uri, "wb+", config) as stream:
        serializer = TensorSerializer(stream, encryption=encryption, **config.serialization_kwargs)
        serializer.write_state_dict(tensors)
        serializer.close()
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    logger.info("tensorized %d tensors (%.1f MiB%s) to %s in %.2f s", len(tensors), nbytes / 2**20,
                ", encrypted" if encryption else "", uri, time.perf_counter() - t0)
    return uri


def load_tensorized(model: nn.Module, config: TensorizerConfig, tp_rank: int) -> bool:
    """Read rank ``tp_rank``'s file with tensorizer's ``TensorDeserializer`` (on the CPU;
    decrypted with ``config.encryption_keyfile``, hashes checked with ``verify_hash``) into
    ``model``, built empty for that rank.

    Returns:
        True when the file is vLLM-tensorized (copied under the model's own names: the caller runs
        ``process_weights_after_loading``); False when it held HF names (the model's
        ``load_weights`` ran, which does that itself).
    Raises:
        ImportError: tensorizer is missing.
        ValueError: the file is encrypted and no (or the wrong) ``encryption_keyfile`` is given;
            as ``sharded_state.copy_state`` (a name or shape the model lacks, tensors missing).
    """
    import_tensorizer()
    from tensorizer import DecryptionParams, TensorDeserializer
    from tensorizer.serialization import CryptographyError

    uri = config.rank_uri(tp_rank)
    kwargs = {"verify_hash": bool(config.verify_hash), "num_readers": config.num_readers,
              **config.deserialization_kwargs}
    if config.encryption_keyfile:
        kwargs["encryption"] = DecryptionParams.from_key(_read_key(config))
    t0 = time.perf_counter()
    try:
        with _open(uri, "rb", config) as stream, TensorDeserializer(stream, device="cpu", **kwargs) as tensors:
            marked = VLLM_TENSORIZED_MARKER in tensors
            named = ((n, t) for n, t in tensors.items() if n != VLLM_TENSORIZED_MARKER)
            if marked:
                copy_state(model, named, f"tensorizer file {uri}")
            else:
                logger.warning("%s has no %s: read as a Hugging Face model's tensors (HF names)", uri,
                               VLLM_TENSORIZED_MARKER)
                model.load_weights(named)
            nbytes = tensors.total_tensor_bytes
    except CryptographyError as e:
        hint = "it is encrypted: pass encryption_keyfile" if not config.encryption_keyfile \
            else f"decryption with encryption_keyfile={config.encryption_keyfile!r} failed (another key?)"
        raise ValueError(f"tensorizer file {uri}: {hint} ({e})") from e
    dt = time.perf_counter() - t0
    logger.info("deserialized %.1f MiB from %s in %.2f s (%.0f MiB/s)", nbytes / 2**20, uri, dt,
                nbytes / 2**20 / max(dt, 1e-9))
    return marked


def write_artifacts(model_folder: str, config: TensorizerConfig) -> list[str]:
    """Copy the model folder's other files (config.json, tokenizer files, generation config)
    into ``config.tensorizer_dir``, so that folder loads as a model with
    ``load_format="tensorizer"`` (vLLM's ``serialize_extra_artifacts``; weights are left out).

    Returns:
        The names written.
    Raises:
        OSError: a file cannot be read or written.
    """
    written = []
    for entry in sorted(os.scandir(model_folder), key=lambda e: e.name):
        if not entry.is_file() or entry.name.endswith(_ARTIFACT_SKIP_SUFFIXES):
            continue
        with open(entry.path, "rb") as src, _open(f"{config.tensorizer_dir}/{entry.name}", "wb+", config) as dst:
            dst.write(src.read())
        written.append(entry.name)
    logger.info("wrote %s to %s", ", ".join(written), config.tensorizer_dir)
    return written
