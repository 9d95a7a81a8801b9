"""vLLM's sharded state (``engine_core.save_sharded_state`` + ``load_format="sharded_state"``,
``loaders/sharded_state.py``): each rank writes its own weights before packing and reads back only
its own files. Tiny random checkpoints in float32; outputs compared with the original folder's."""

from __future__ import annotations

import os
import shutil

import pytest

from pagedllm import LLM
from pagedllm.model_executor.model_loader import ShardedStateLoader

from saved_weights_utils import ENGINE_KW, greedy_ids


def _save(ckpt: str, out: str, tp: int, **save_kw) -> list[str]:
    """What vLLM's save_sharded_state_offline.py does: save, then copy the other files."""
    llm = LLM(ckpt, **ENGINE_KW, tensor_parallel_size=tp)
    try:
        os.makedirs(out, exist_ok=True)
        llm.llm_engine.engine_core.save_sharded_state(path=out, **save_kw)
    finally:
        llm.llm_engine.shutdown()
    for name in os.listdir(ckpt):
        if os.path.splitext(name)[1] not in (".bin", ".pt", ".safetensors"):
            shutil.copy(os.path.join(ckpt, name), out)
    return sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))


@pytest.fixture(scope="module")
def gemma_tp1(make_tiny_checkpoint, tmp_path_factory):
    """A tiny Gemma 3 (tied head, norm caches) saved at tp=1 in files of at most 64 KiB."""
    ckpt = make_tiny_checkpoint("gemma3", tie_word_embeddings=False)
    out = str(tmp_path_factory.mktemp("sharded_gemma"))
    return ckpt, out, _save(ckpt, out, 1, pattern=None, max_size=64 << 10)


def test_patterns_have_vllm_names():
    assert ShardedStateLoader.TP_ONLY_PATTERN == "model-rank-{rank}-part-{part}.safetensors"
    assert ShardedStateLoader.PP_AND_TP_PATTERN == "model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors"
    assert ShardedStateLoader.DEFAULT_PATTERN == ShardedStateLoader.TP_ONLY_PATTERN


def test_save_then_load_tp1_gives_the_same_outputs(gemma_tp1):
    ckpt, out, files = gemma_tp1
    assert len(files) > 1 and all(f.startswith("model-rank-0-part-") for f in files)   # split at max_size
    assert os.path.isfile(os.path.join(out, "config.json"))
    want = greedy_ids(LLM(ckpt, **ENGINE_KW))
    assert greedy_ids(LLM(out, **ENGINE_KW, load_format="sharded_state")) == want


def test_load_with_another_tensor_parallel_size_is_a_value_error(gemma_tp1):
    _, out, _ = gemma_tp1
    with pytest.raises(ValueError, match="saved with tensor_parallel_size=1.*not tensor_parallel_size=2"):
        LLM(out, **ENGINE_KW, load_format="sharded_state", tensor_parallel_size=2)


def test_a_missing_shard_is_a_value_error(gemma_tp1, tmp_path):
    _, out, files = gemma_tp1
    broken = str(tmp_path / "broken")
    shutil.copytree(out, broken)
    os.remove(os.path.join(broken, files[1]))
    with pytest.raises(ValueError, match=r"lacks part\(s\) \[1\] .*tp_rank=0, pp_rank=0"):
        LLM(broken, **ENGINE_KW, load_format="sharded_state")

def test_a_folder_without_a_sharded_state_is_a_value_error(make_tiny_checkpoint):
    with pytest.raises(ValueError, match="no sharded-state files"):
        LLM(make_tiny_checkpoint("llama"), **ENGINE_KW, load_format="sharded_state")


def test_bad_patterns_are_value_errors(make_tiny_checkpoint, tmp_path):
    from pagedllm.loaders.sharded_state import render_pattern

    assert render_pattern(None, 1, 2, 0, 1, 3) == "model-rank-1-part-3.safetensors"
    assert render_pattern(None, 1, 2, 1, 2, 0) == "model-pp-1-tp-1-part-0.safetensors"
    with pytest.raises(ValueError, match="no {rank}"):
        render_pattern("model-part-{part}.safetensors", 0, 2, 0, 1, 0)
    with pytest.raises(ValueError, match="no {pp_rank}"):
        render_pattern(ShardedStateLoader.TP_ONLY_PATTERN, 0, 1, 0, 2, 0)
    with pytest.raises(ValueError, match="placeholder"):
        render_pattern("model-{worker}-{part}.safetensors", 0, 1, 0, 1, 0)
    llm = LLM(make_tiny_checkpoint("llama"), **ENGINE_KW)
    try:
        with pytest.raises(ValueError, match="placeholder"):
            llm.llm_engine.engine_core.save_sharded_state(path=str(tmp_path), pattern="x-{worker}-{part}")
        with pytest.raises(ValueError, match="max_size"):
            llm.llm_engine.engine_core.save_sharded_state(path=str(tmp_path), max_size=0)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.multiprocess
def test_save_then_load_tp2_each_rank_reads_its_own_files(make_tiny_checkpoint, tmp_path):
    ckpt = make_tiny_checkpoint("llama")
    out = str(tmp_path / "sharded_tp2")
    files = _save(ckpt, out, 2, pattern=ShardedStateLoader.TP_ONLY_PATTERN)
    assert files == ["model-rank-0-part-0.safetensors", "model-rank-1-part-0.safetensors"]
    want = greedy_ids(LLM(ckpt, **ENGINE_KW))
    assert greedy_ids(LLM(out, **ENGINE_KW, load_format="sharded_state", tensor_parallel_size=2)) == want
    with pytest.raises(ValueError, match="saved with tensor_parallel_size=2"):
        LLM(out, **ENGINE_KW, load_format="sharded_state")
    os.remove(os.path.join(out, files[1]))
    with pytest.raises(ValueError, match="no file for tp_rank=1"):
        LLM(out, **ENGINE_KW, load_format="sharded_state", tensor_parallel_size=2)


def test_a_tied_head_is_saved_once(make_tiny_checkpoint, tmp_path):
    from safetensors import safe_open

    ckpt = make_tiny_checkpoint("qwen2")   # tied: lm_head.weight is embed_tokens.weight
    out = str(tmp_path / "sharded_qwen2")
    files = _save(ckpt, out, 1)
    assert files == ["model-rank-0-part-0.safetensors"]
    with safe_open(os.path.join(out, files[0]), framework="pt") as f:
        names = set(f.keys())
        assert f.metadata()["tp_size"] == "1" and f.metadata()["num_parts"] == "1"
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    want = greedy_ids(LLM(ckpt, **ENGINE_KW))
    assert greedy_ids(LLM(out, **ENGINE_KW, load_format="sharded_state")) == want
