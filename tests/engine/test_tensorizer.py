"""vLLM's tensorizer serialization (``tensorize_vllm_model`` + ``load_format="tensorizer"``,
``loaders/tensorizer.py``): each rank writes its weights before packing with CoreWeave's
tensorizer and reads back only its own file. Tiny random checkpoints in float32; outputs compared
with the original folder's."""

from __future__ import annotations

import os

import pytest

from pagedllm import LLM
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.model_executor.model_loader.tensorizer import (TensorizerArgs, TensorizerConfig,
                                                             tensorize_vllm_model, tensorizer_kwargs_arg)

from saved_weights_utils import ENGINE_KW, greedy_ids

pytest.importorskip("tensorizer")


def _tensorize(ckpt: str, uri: str, tp: int = 1, keyfile: str | None = None) -> TensorizerConfig:
    config = TensorizerConfig(tensorizer_uri=uri, encryption_keyfile=keyfile)
    tensorize_vllm_model(EngineArgs(model=ckpt, tensor_parallel_size=tp, **ENGINE_KW), config)
    return config


@pytest.fixture(scope="module")
def gemma(make_tiny_checkpoint, tmp_path_factory):
    """A tiny Gemma 3 (untied head, norm caches) tensorized at tp=1 into ``<dir>/model.tensors``."""
    ckpt = make_tiny_checkpoint("gemma3", tie_word_embeddings=False)
    out = str(tmp_path_factory.mktemp("tensorized_gemma"))
    _tensorize(ckpt, f"{out}/model.tensors")
    return ckpt, out


def test_serialize_then_load_gives_the_same_outputs(gemma):
    ckpt, out = gemma
    assert {"config.json", "model.tensors", "tokenizer.json"} <= set(os.listdir(out))
    assert not any(n.endswith(".safetensors") for n in os.listdir(out))
    want = greedy_ids(LLM(ckpt, **ENGINE_KW))
    # The folder as the model (vLLM's LLM(dir, load_format="tensorizer")) and the checkpoint's own
    # config with the file named in model_loader_extra_config (the example script's deserialize).
    assert greedy_ids(LLM(out, **ENGINE_KW, load_format="tensorizer")) == want
    cfg = TensorizerConfig(tensorizer_uri=f"{out}/model.tensors")
    assert greedy_ids(LLM(ckpt, **ENGINE_KW, load_format="tensorizer", model_loader_extra_config=cfg)) == want
    assert greedy_ids(LLM(ckpt, **ENGINE_KW, load_format="tensorizer",
                           model_loader_extra_config=f'{{"tensorizer_dir": "{out}", "num_readers": 1}}')) == want


def test_the_file_holds_the_checkpoint_tensors_by_the_models_names(gemma):
    import torch
    from safetensors.torch import load_file
    from tensorizer import TensorDeserializer

    ckpt, out = gemma
    hf = load_file(os.path.join(ckpt, "model.safetensors"))
    with TensorDeserializer(f"{out}/model.tensors", device="cpu") as tensors:
        saved = {n: t.detach().clone() for n, t in tensors.items()}
    assert saved.pop(".vllm_tensorized_marker").tolist() == [1]
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.down_proj.weight",
                 "model.layers.1.post_feedforward_layernorm.weight", "model.norm.weight"):
        assert saved[name].dtype == torch.float32 and torch.equal(saved[name], hf[name]), name
    # Merged layers under the model's own names: q / k / v stacked in that order.
    layer = "model.layers.0.self_attn"
    qkv = torch.cat([hf[f"{layer}.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(saved[f"{layer}.qkv_proj.weight"], qkv)


def test_encrypted_round_trip_and_without_the_key(make_tiny_checkpoint, tmp_path):
    from tensorizer import _crypt
    if not _crypt.available:   # tensorizer's encryption loads the system's libsodium (libnacl)
        pytest.skip("libsodium is not installed")
    ckpt = make_tiny_checkpoint("llama")
    key = str(tmp_path / "model.key")
    config = _tensorize(ckpt, str(tmp_path / "enc" / "model.tensors"), keyfile=key)
    assert os.path.getsize(key) == 32   # a random libsodium secretbox key
    want = greedy_ids(LLM(ckpt, **ENGINE_KW))
    extra = {"tensorizer_uri": config.tensorizer_uri, "encryption_keyfile": key}
    assert greedy_ids(LLM(ckpt, **ENGINE_KW, load_format="tensorizer", model_loader_extra_config=extra)) == want
    with pytest.raises(ValueError, match="it is encrypted: pass encryption_keyfile"):
        LLM(ckpt, **ENGINE_KW, load_format="tensorizer",
            model_loader_extra_config={"tensorizer_uri": config.tensorizer_uri})
    other = tmp_path / "other.key"
    other.write_bytes(bytes(32))
    with pytest.raises(ValueError, match="decryption with encryption_keyfile=.*other.key.* failed"):
        LLM(ckpt, **ENGINE_KW, load_format="tensorizer",
            model_loader_extra_config={**extra, "encryption_keyfile": str(other)})


@pytest.mark.parametrize("kwargs, match", [
    ({}, "tensorizer_uri or tensorizer_dir must be given"),
    ({"tensorizer_uri": "/a/model.tensors", "tensorizer_dir": "/b"}, "tensorizer_dir='/b' and tensorizer_uri"),
    ({"tensorizer_uri": "/a/model.tensors", "num_readers": 0}, "num_readers must be"),
    ({"tensorizer_uri": "/a/model.tensors", "deserialization_kwargs": {"device": "cuda"}},
     r"deserialization_kwargs may not set \['device'\]"),
    ({"tensorizer_uri": "/a/model.tensors", "serialization_kwargs": "x"}, "serialization_kwargs must be a dict"),
])
def test_bad_configs_are_value_errors_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TensorizerConfig(**kwargs)


def test_config_resolution_and_serializable_form():
    by_dir = TensorizerConfig(tensorizer_dir="/a/b/")
    assert by_dir.tensorizer_uri == "/a/b/model.tensors" and not by_dir.is_sharded
    both = TensorizerConfig(tensorizer_uri="/a/b/model.tensors", tensorizer_dir="/a/b")
    assert both.to_serializable() == {"tensorizer_uri": "/a/b/model.tensors"}
    sharded = TensorizerConfig(tensorizer_uri="s3://bucket/m/model-rank-%03d.tensors", num_readers=2)
    assert sharded.is_sharded and sharded.rank_uri(1) == "s3://bucket/m/model-rank-001.tensors"
    assert TensorizerConfig(**sharded.to_serializable()) == sharded
    assert TensorizerArgs(sharded).tensorizer_uri == sharded.tensorizer_uri
    with pytest.raises(ValueError, match="tensorizer_uri='/a/model.tensors' needs a rank template"):
        TensorizerConfig(tensorizer_uri="/a/model.tensors").verify_with_parallel_config(2, 1)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 is not supported"):
        sharded.verify_with_parallel_config(1, 2)
    assert tensorizer_kwargs_arg('{"limit_cpu_concurrency": 2}') == {"limit_cpu_concurrency": 2}
    import argparse
    with pytest.raises(argparse.ArgumentTypeError):
        tensorizer_kwargs_arg("[1]")


def test_bad_extra_configs_fail_before_any_weight_loads(make_tiny_checkpoint, tmp_path):
    ckpt = make_tiny_checkpoint("llama")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['tensorizer_url'\]"):
        LLM(ckpt, **ENGINE_KW, load_format="tensorizer", model_loader_extra_config={"tensorizer_url": "x"})
    with pytest.raises(ValueError, match=r"\['dtype'\] not allowed Tensorizer arguments"):
        LLM(ckpt, **ENGINE_KW, load_format="tensorizer", model_loader_extra_config={"dtype": "float16"})
    with pytest.raises(ValueError, match="tensorizer_uri .*model.tensors.* does not exist"):
        LLM(ckpt, **ENGINE_KW, load_format="tensorizer")   # the model folder holds no model.tensors
    with pytest.raises(ValueError, match="load_format='tensorizer' only"):
        LLM(ckpt, **ENGINE_KW, model_loader_extra_config={"tensorizer_uri": "x"})
    with pytest.raises(ValueError, match="needs a rank template"):
        LLM(ckpt, **ENGINE_KW, load_format="tensorizer", tensor_parallel_size=2,
            model_loader_extra_config={"tensorizer_uri": str(tmp_path / "model.tensors")})


def test_without_the_package_the_format_is_an_import_error_naming_the_extra(make_tiny_checkpoint, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "tensorizer", None)   # import tensorizer -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'pagedllm\[tensorizer\]'"):
        EngineArgs(model=make_tiny_checkpoint("llama"), load_format="tensorizer", **ENGINE_KW).create_engine_config()


@pytest.mark.multiprocess
def test_serialize_then_load_tp2_each_rank_reads_its_own_file(make_tiny_checkpoint, tmp_path):
    ckpt = make_tiny_checkpoint("llama")
    out = tmp_path / "tp2"
    config = _tensorize(ckpt, f"{out}/model-rank-%03d.tensors", tp=2)
    assert sorted(n for n in os.listdir(out) if n.endswith(".tensors")) == \
        ["model-rank-000.tensors", "model-rank-001.tensors"]
    want = greedy_ids(LLM(ckpt, **ENGINE_KW))
    got = greedy_ids(LLM(str(out), **ENGINE_KW, load_format="tensorizer", tensor_parallel_size=2,
                          model_loader_extra_config=config))
    assert got == want
    os.remove(out / "model-rank-001.tensors")
    with pytest.raises(ValueError, match=r"model-rank-001.tensors' \(tp rank 1\) does not exist"):
        LLM(str(out), **ENGINE_KW, load_format="tensorizer", tensor_parallel_size=2,
            model_loader_extra_config=config)


def test_cli_flags_reach_the_model_config(gemma):
    from pagedllm.utils.argparse_utils import FlexibleArgumentParser

    ckpt, out = gemma
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    ns = parser.parse_args(["--model", ckpt, "--load-format", "tensorizer", "--dtype", "float32",
                            "--model-loader-extra-config", f'{{"tensorizer_uri": "{out}/model.tensors", '
                                                          '"verify_hash": true}'])
    model_config = EngineArgs.from_cli_args(ns).create_engine_config().model_config
    assert model_config.load_format == "tensorizer"
    assert model_config.model_loader_extra_config == {"tensorizer_uri": f"{out}/model.tensors", "verify_hash": True}


def test_reload_weights_from_the_tensorized_file(gemma):
    """vLLM's dummy start, then ``update_config`` to the tensorized file and ``reload_weights``."""
    ckpt, out = gemma
    want = greedy_ids(LLM(ckpt, **ENGINE_KW))
    llm = LLM(ckpt, **ENGINE_KW, load_format="dummy")
    try:
        extra = {"tensorizer_uri": f"{out}/model.tensors"}
        llm.collective_rpc("update_config", args=({"load_config": {"load_format": "tensorizer",
                                                                   "model_loader_extra_config": extra}},))
        llm.collective_rpc("reload_weights")
        llm.collective_rpc("update_config", args=({"load_config": {"load_format": "auto"}},))
        with pytest.raises(ValueError, match=r"unknown key\(s\) \['uri'\]"):
            llm.collective_rpc("update_config", args=({"load_config": {"load_format": "tensorizer",
                                                                       "model_loader_extra_config": {"uri": "x"}}},))
    except BaseException:
        llm.llm_engine.shutdown()
        raise
    assert greedy_ids(llm) == want
