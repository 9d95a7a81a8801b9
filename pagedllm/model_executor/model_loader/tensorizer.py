"""vLLM's ``vllm.model_executor.model_loader.tensorizer``, the names its
``examples/features/tensorize_vllm_model.py`` imports: ``TensorizerConfig``
(``loaders/tensorizer_config.py``), ``TensorizerArgs`` (the deserializer's CLI flags),
``tensorizer_kwargs_arg`` and ``tensorize_vllm_model`` (start an engine, have every rank write its
weights with tensorizer: ``loaders/tensorizer.py``)."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from pagedllm.loaders.tensorizer_config import TensorizerConfig

if TYPE_CHECKING:
    from pagedllm.engine.arg_utils import EngineArgs


def tensorizer_kwargs_arg(value: str) -> dict[str, Any]:
    """argparse ``type`` of ``--serialization-kwargs`` / ``--deserialization-kwargs``: a JSON object.

    Raises:
        argparse.ArgumentTypeError: the JSON is not an object.
    """
    loaded = json.loads(value)
    if not isinstance(loaded, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {value!r}; serialization_kwargs and "
                                         "deserialization_kwargs must be JSON objects")
    return loaded


class TensorizerArgs:
    """vLLM's ``TensorizerArgs``: a ``TensorizerConfig``'s fields as attributes, and the
    ``tensorizer options`` CLI flags (``add_cli_args``)."""

    def __init__(self, tensorizer_config: TensorizerConfig) -> None:
        for key, value in vars(tensorizer_config).items():
            setattr(self, key, value)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add vLLM's ``tensorizer options`` group (``--tensorizer-uri``, ``--verify-hash``,
        ``--encryption-keyfile``, ``--num-readers``, ``--s3-access-key-id``,
        ``--s3-secret-access-key``, ``--s3-endpoint``) to ``parser``.

        Returns:
            ``parser``.
        """
        group = parser.add_argument_group(
            "tensorizer options", description="TensorizerConfig's fields for load_format=tensorizer (also "
                                              "accepted as --model-loader-extra-config JSON)")
        group.add_argument("--tensorizer-uri", type=str, help="the serialized tensors: a local path, or an "
                                                               "s3:// or http(s):// URI")
        group.add_argument("--verify-hash", action="store_true",
                           help="check every tensor's hash against the file's; a mismatch is an error")
        group.add_argument("--encryption-keyfile", type=str, default=None,
                           help="the binary key file to decrypt with (local path or S3 URI)")
        group.add_argument("--num-readers", type=int, default=None,
                           help="threads reading the file at once (default: tensorizer's choice)")
        group.add_argument("--s3-access-key-id", type=str, default=None, help="S3 access key (or $S3_ACCESS_KEY_ID)")
        group.add_argument("--s3-secret-access-key", type=str, default=None,
                           help="S3 secret key (or $S3_SECRET_ACCESS_KEY)")
        group.add_argument("--s3-endpoint", type=str, default=None, help="S3 endpoint (or $S3_ENDPOINT_URL)")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "TensorizerArgs":
        """From a namespace parsed with ``add_cli_args``.

        Raises:
            ValueError: as ``TensorizerConfig`` (no ``--tensorizer-uri``, a bad value).
        """
        names = TensorizerConfig.__dataclass_fields__
        return cls(TensorizerConfig(**{k: v for k, v in vars(args).items() if k in names and v is not None}))


def tensorize_vllm_model(engine_args: "EngineArgs", tensorizer_config: TensorizerConfig,
                         generate_keyfile: bool = True) -> None:
    """Load the model named by ``engine_args`` and write every rank's weights with tensorizer
    (vLLM's): the state as loaded, before packing, to ``tensorizer_uri`` (rendered with the
    tensor-parallel rank), then the model folder's config and tokenizer files into
    ``tensorizer_dir``, so that folder loads with ``LLM(folder, load_format="tensorizer")``.

    Args:
        generate_keyfile: with ``encryption_keyfile``, write a fresh random key there first and
            encrypt with it (False: encrypt with the key already there).
    Raises:
        ImportError: tensorizer (or, for encryption, its libsodium binding) is missing.
        ValueError: a bad ``tensorizer_config`` (as ``TensorizerConfig``, its parallel check),
            or bad engine arguments.
    """
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.loaders.tensorizer import import_tensorizer, write_artifacts, write_random_key

    config = TensorizerConfig(**tensorizer_config.to_serializable())   # the fields as set now, validated
    config.verify_with_parallel_config(engine_args.tensor_parallel_size, engine_args.pipeline_parallel_size)
    import_tensorizer()
    if generate_keyfile and config.encryption_keyfile is not None:
        write_random_key(config)   # before the ranks start: they all encrypt with this key
    engine = LLMEngine(engine_args)
    try:
        engine.collective_rpc("save_tensorized_model", kwargs={"tensorizer_config": config.to_serializable()})
        write_artifacts(engine.model_config.model_folder, config)
    finally:
        engine.shutdown()


__all__ = ["TensorizerArgs", "TensorizerConfig", "tensorize_vllm_model", "tensorizer_kwargs_arg"]
