"""The helpers vLLM's Model Runner V2 processors import: ``async_tensor_h2d``, ``gpu_sync_allowed``,
``cached_tokenizer_from_config`` / ``Tokenizer.batch_decode``; and the V2 interface stays
torch-free at import time (the engine process imports processor classes to validate)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch

from pagedllm.utils.gpu_sync_debug import gpu_sync_allowed
from pagedllm.utils.torch_utils import async_tensor_h2d


def test_async_tensor_h2d_copies_keeping_dtype_and_values():
    a = np.array([3, 1, 2], dtype=np.int64)
    t = async_tensor_h2d(a, "cpu")
    assert t.dtype == torch.int64 and t.tolist() == [3, 1, 2]
    a[0] = 9                                     # a copy, not a view
    assert t.tolist() == [3, 1, 2]
    mask = async_tensor_h2d(np.array([True, False]), torch.device("cpu"))
    assert mask.dtype == torch.bool and mask.tolist() == [True, False]
    assert async_tensor_h2d(np.arange(4, dtype=np.float32)[::2], "cpu").tolist() == [0.0, 2.0]   # strided
    assert async_tensor_h2d([1, 2], "cpu", dtype=torch.int32).dtype == torch.int32
    out = torch.zeros(2, dtype=torch.float32)
    assert async_tensor_h2d(np.array([1, 2]), None, out=out) is out and out.tolist() == [1.0, 2.0]


def test_gpu_sync_allowed_is_a_plain_region():
    with gpu_sync_allowed():
        x = torch.ones(2).sum().item()
    assert x == 2.0


def test_cached_tokenizer_from_config_and_batch_decode(make_tiny_checkpoint, tiny_tokenizer_dir):
    from pagedllm.config import ModelConfig
    from pagedllm.tokenizers import cached_get_tokenizer, cached_tokenizer_from_config

    path = make_tiny_checkpoint("llama")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert {"tokenizer", "model_folder", "model"} <= fields

    class Cfg:   # the three fields the call reads
        def __init__(self, tokenizer=None, model_folder=None, model=None):
            self.tokenizer, self.model_folder, self.model = tokenizer, model_folder, model

    tok = cached_tokenizer_from_config(Cfg(model_folder=path))
    assert tok is cached_get_tokenizer(path) and tok is cached_tokenizer_from_config(Cfg(model=path))
    assert cached_tokenizer_from_config(Cfg(tokenizer=tiny_tokenizer_dir, model_folder=path)) is \
        cached_get_tokenizer(tiny_tokenizer_dir)
    ids = [tok.encode("hello world", add_special_tokens=False), tok.encode("a b", add_special_tokens=False)]
    assert tok.batch_decode(ids) == [tok.decode(i) for i in ids]
    assert tok.batch_decode([[i] for i in range(5)]) == [tok.decode([i]) for i in range(5)]


def test_v2_interface_imports_without_torch():
    script = ("import sys\nimport pagedllm.v1.worker.gpu.sample.logits_processor.interface\n"
              "sys.exit(3 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", script]).returncode == 0


def test_v2_processor_must_implement_apply():
    from pagedllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor

    class NoApply(LogitsProcessor):
        pass

    with pytest.raises(TypeError):
        NoApply(None, None)
