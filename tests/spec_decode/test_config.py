"""``speculative_config``: vLLM's keys, defaults and errors (each naming its key), checked before
any weight loads; the ``--speculative-config`` flag."""

from __future__ import annotations

import argparse

import pytest

from pagedllm import LLM
from pagedllm.config import SpeculativeConfig
from pagedllm.engine.arg_utils import EngineArgs, add_engine_cli_args, engine_args_from_cli


def test_ngram_defaults_follow_vllm():
    cfg = SpeculativeConfig.from_any({"method": "ngram", "num_speculative_tokens": 3})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (5, 5)
    assert SpeculativeConfig.from_any({"method": "ngram", "num_speculative_tokens": 3,
                                       "prompt_lookup_max": 4}).prompt_lookup_min == 4
    assert SpeculativeConfig.from_any({"method": "ngram", "num_speculative_tokens": 3,
                                       "prompt_lookup_min": 2}).prompt_lookup_max == 2


def test_suffix_defaults_to_tree_depth_and_model_implies_draft_model():
    assert SpeculativeConfig.from_any({"method": "suffix"}).num_speculative_tokens == 24
    assert SpeculativeConfig.from_any({"method": "suffix", "suffix_decoding_max_tree_depth": 8}
                                      ).num_speculative_tokens == 8
    assert SpeculativeConfig.from_any({"model": "/some/draft", "num_speculative_tokens": 2}).method == "draft_model"
    assert SpeculativeConfig.from_any(None) is None


@pytest.mark.parametrize("value, key", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "suffix", "prompt_lookup_max": 3}, "prompt_lookup_max"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "/x"}, "model"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob"),
    ({"method": "suffix", "suffix_decoding_max_spec_factor": 0}, "suffix_decoding_max_spec_factor"),
    ({"method": "suffix", "suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "draft_tensor_parallel_size"),
    ("ngram", "speculative_config"),
])
def test_bad_values_name_their_key(value, key):
    with pytest.raises(ValueError, match=key):
        SpeculativeConfig.from_any(value)


def test_errors_come_before_any_weight_loads(tmp_path):
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(missing, speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        LLM(missing, pipeline_parallel_size=2, speculative_config={"method": "suffix"})
    with pytest.raises(ValueError, match="logits_processors"):
        EngineArgs(model=missing, logits_processors=["x:Y"],
                   speculative_config={"method": "suffix"}).create_speculative_config()


def test_cli_flag_parses_json():
    parser = argparse.ArgumentParser()
    add_engine_cli_args(parser)
    ns = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    args = engine_args_from_cli(ns)
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    assert args.create_speculative_config().num_speculative_tokens == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "[1, 2]"])
