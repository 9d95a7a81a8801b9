"""Small helpers with vLLM's import paths: ``FlexibleArgumentParser`` (``vllm.utils``),
``random_uuid`` (``vllm.utils``) and ``set_random_seed`` (``vllm.utils.torch_utils``)."""

import uuid

from pagedllm.utils.argparse_utils import FlexibleArgumentParser


def random_uuid() -> str:
    """A fresh random id: 32 lowercase hex digits (a UUID4's), e.g. for a request id."""
    return uuid.uuid4().hex


__all__ = ["FlexibleArgumentParser", "random_uuid"]
