"""``TensorizerConfig``: where a model serialized with CoreWeave's tensorizer lives and how to read
it (vLLM's ``load_format="tensorizer"`` / ``model_loader_extra_config``), validated once; no
torch, no tensorizer import (``loaders/tensorizer.py`` does the reading and writing).

One file per tensor-parallel rank: with ``tensor_parallel_size`` > 1 ``tensorizer_uri`` carries a
``%0Nd`` template (``model-rank-%03d.tensors``) rendered with the rank, as vLLM's.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, fields
from typing import Any

# vLLM's TensorizerLoader refuses these: the engine decides the device and dtype.
BLACKLISTED_TENSORIZER_ARGS = frozenset({"device", "dtype", "mode"})
_RANK_TEMPLATE = re.compile(r"%0\dd")
DEFAULT_TENSORS_NAME = "model.tensors"


@dataclass
class TensorizerConfig:
    """vLLM's ``TensorizerConfig`` (its field names): a mutable dataclass, as vLLM's example
    script sets fields after construction; the engine validates a fresh copy
    (``TensorizerConfig(**cfg.to_serializable())``).

    Attributes:
        tensorizer_uri: the serialized tensors: a local path, ``s3://`` or ``http(s)://`` URI;
            with several tensor-parallel ranks a ``%0Nd`` template rendered with each rank.
        tensorizer_dir: a folder holding ``model.tensors`` (and the config / tokenizer files
            written beside it); the folder of ``tensorizer_uri`` when that is given.
        vllm_tensorized: accepted, ignored (vLLM's deprecated flag: files are marked).
        verify_hash: check each tensor's hash against the file's (tensorizer's ``verify_hash``).
        num_readers: threads reading the file at once (None: tensorizer's choice).
        encryption_keyfile: the binary key (libsodium, tensorizer's ``EncryptionParams``):
            serializing writes a fresh random key there; deserializing reads it to decrypt.
        s3_access_key_id, s3_secret_access_key, s3_endpoint: S3 credentials for ``s3://`` URIs.
        stream_kwargs: more keyword arguments of tensorizer's ``stream_io.open_stream``.
        serialization_kwargs: more keyword arguments of ``TensorSerializer``.
        deserialization_kwargs: more keyword arguments of ``TensorDeserializer``.
    Raises:
        ValueError: neither ``tensorizer_uri`` nor ``tensorizer_dir``; a ``tensorizer_dir`` other
            than ``tensorizer_uri``'s folder; ``num_readers`` < 1; a kwargs field that is not a
            dict or holds ``device`` / ``dtype`` / ``mode`` (each naming the field).
    """

    tensorizer_uri: str | None = None
    tensorizer_dir: str | None = None
    vllm_tensorized: bool | None = None
    verify_hash: bool | None = None
    num_readers: int | None = None
    encryption_keyfile: str | None = None
    s3_access_key_id: str | None = None
    s3_secret_access_key: str | None = None
    s3_endpoint: str | None = None
    stream_kwargs: dict[str, Any] | None = None
    serialization_kwargs: dict[str, Any] | None = None
    deserialization_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not self.tensorizer_uri and not self.tensorizer_dir:
            raise ValueError("tensorizer_uri or tensorizer_dir must be given (the serialized tensors, "
                             f"or a folder holding {DEFAULT_TENSORS_NAME})")
        if self.tensorizer_uri:
            folder = os.path.dirname(self.tensorizer_uri)
            if self.tensorizer_dir and self.tensorizer_dir.rstrip("/") != folder.rstrip("/"):
                raise ValueError(f"tensorizer_dir={self.tensorizer_dir!r} and tensorizer_uri="
                                 f"{self.tensorizer_uri!r} disagree: give one of them")
            self.tensorizer_dir = folder
        else:
            self.tensorizer_uri = f"{self.tensorizer_dir.rstrip('/')}/{DEFAULT_TENSORS_NAME}"
        if self.num_readers is not None and (isinstance(self.num_readers, bool) or not isinstance(
                self.num_readers, int) or self.num_readers < 1):
            raise ValueError(f"num_readers must be an int >= 1 or None, got {self.num_readers!r}")
        for name in ("stream_kwargs", "serialization_kwargs", "deserialization_kwargs"):
            value = getattr(self, name)
            if value is None:
                setattr(self, name, {})
            elif not isinstance(value, dict):
                raise ValueError(f"{name} must be a dict, got {type(value).__name__}")
            elif name != "stream_kwargs" and BLACKLISTED_TENSORIZER_ARGS & set(value):
                raise ValueError(f"{name} may not set {sorted(BLACKLISTED_TENSORIZER_ARGS & set(value))} "
                                 "(the engine decides them)")

    @property
    def is_sharded(self) -> bool:
        """Whether ``tensorizer_uri`` is a per-rank template (``%0Nd``)."""
        return _RANK_TEMPLATE.search(self.tensorizer_uri) is not None

    def rank_uri(self, tp_rank: int) -> str:
        """``tensorizer_uri`` of tensor-parallel rank ``tp_rank`` (the template rendered)."""
        return self.tensorizer_uri % tp_rank if self.is_sharded else self.tensorizer_uri

    def verify_with_parallel_config(self, tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
        """Check that every rank gets a file of its own (vLLM's check, by sizes).

        Raises:
            ValueError: ``tensor_parallel_size`` > 1 without a ``%0Nd`` template in
                ``tensorizer_uri``; ``pipeline_parallel_size`` > 1 (vLLM's tensorizer names files
                by the tensor-parallel rank only: stages would overwrite each other).
        """
        if pipeline_parallel_size > 1:
            raise ValueError(f"load_format='tensorizer' names files by the tensor-parallel rank only; "
                             f"pipeline_parallel_size={pipeline_parallel_size} is not supported (use "
                             "load_format='sharded_state' with pipeline stages)")
        if tensor_parallel_size > 1 and not self.is_sharded:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size}: tensorizer_uri="
                             f"{self.tensorizer_uri!r} needs a rank template such as '%03d' "
                             "(e.g. .../model-rank-%03d.tensors), one file per rank")

    def to_serializable(self) -> dict[str, Any]:
        """The fields that are set, as a plain (picklable, JSON-able) dict from which
        ``TensorizerConfig(**d)`` rebuilds this config; ``tensorizer_dir`` is left out
        (``tensorizer_uri`` implies it)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.pop("tensorizer_dir")
        return {k: v for k, v in out.items() if v is not None and v != {}}

    @classmethod
    def from_extra_config(cls, extra: "TensorizerConfig | dict[str, Any] | str | None",
                          default_dir: str | None) -> "TensorizerConfig":
        """The config of ``model_loader_extra_config`` (vLLM's): a ``TensorizerConfig``, a dict of
        its fields (or vLLM's ``{"tensorizer_config": {...}}``), a JSON string of one, or None.
        Without ``tensorizer_uri`` / ``tensorizer_dir``, the folder is ``default_dir`` (the
        model's, as vLLM's ``tensorizer_dir = model``).

        Raises:
            ValueError: an unknown key, ``device`` / ``dtype`` / ``mode``, JSON that is not an
                object (naming ``model_loader_extra_config``); as ``__post_init__``.
        """
        if isinstance(extra, cls):
            extra = extra.to_serializable()
        if isinstance(extra, str):
            try:
                extra = json.loads(extra)
            except json.JSONDecodeError as e:
                raise ValueError(f"model_loader_extra_config is not valid JSON: {e}") from e
        if extra is not None and not isinstance(extra, dict):
            raise ValueError(f"model_loader_extra_config must be a dict, got {type(extra).__name__}")
        extra = dict(extra or {})
        extra.update(extra.pop("tensorizer_config", None) or {})
        bad = sorted(k for k, v in extra.items() if k in BLACKLISTED_TENSORIZER_ARGS and v is not None)
        if bad:
            raise ValueError(f"model_loader_extra_config: {bad} not allowed Tensorizer arguments (the engine "
                             "decides them)")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"model_loader_extra_config has unknown key(s) {unknown}; TensorizerConfig's "
                             f"fields: {sorted(known)}")
        if not extra.get("tensorizer_uri") and not extra.get("tensorizer_dir"):
            extra["tensorizer_dir"] = default_dir
        return cls(**extra)
