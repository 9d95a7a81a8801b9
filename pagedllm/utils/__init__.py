"""Small helpers with vLLM's import paths: ``FlexibleArgumentParser`` (``vllm.utils``) and
``set_random_seed`` (``vllm.utils.torch_utils``)."""

from pagedllm.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
