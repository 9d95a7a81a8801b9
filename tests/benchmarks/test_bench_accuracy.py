"""``pagedllm bench accuracy``: the metrics by hand, and the reference side against transformers."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pagedllm.benchmarks.accuracy import RequestScore, compare_scores
from pagedllm.entrypoints.cli import main

ENGINE_FLAGS = ["--kv-cache-memory-bytes", "8MiB", "--max-model-len", "256", "--block-size", "8"]


def test_compare_scores_by_hand():
    reference = [RequestScore([-1.0, -2.0], [5, 6], [1, 2, 3]), RequestScore([-3.0], [7], [4, 5])]
    candidate = [RequestScore([-1.5, -2.0], [5, 9], [1, 2, 9]), RequestScore([-2.0], [7], [4, 5])]
    res = compare_scores(reference, candidate)
    assert res["num_scored_tokens"] == 3 and res["num_requests"] == 2
    assert res["reference_perplexity"] == pytest.approx(math.exp(6 / 3))
    assert res["perplexity"] == pytest.approx(math.exp(5.5 / 3))
    assert res["perplexity_ratio"] == pytest.approx(math.exp(-0.5 / 3))
    assert res["mean_abs_logprob_diff"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert res["top1_agreement"] == pytest.approx(2 / 3)
    assert res["greedy_exact_fraction"] == 0.5
    assert res["mean_greedy_prefix_tokens"] == 2.0     # (2 + 2) / 2


def test_compare_scores_rejects_different_prompts():
    with pytest.raises(ValueError, match="same prompts"):
        compare_scores([RequestScore([-1.0], [1], [1])], [RequestScore([-1.0, -2.0], [1, 2], [1])])


def _hf_perplexity(model_dir: str, prompts: list[list[int]], int8: bool = False) -> float:
    """transformers' perplexity of ``prompts`` (each alone), with every linear layer (LM head
    included) swapped for our ``Int8DynamicLinear`` when ``int8``."""
    from torch import nn
    from transformers import AutoModelForCausalLM

    from pagedllm.layers.quantization import Int8DynamicLinear

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if int8:
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, Int8DynamicLinear(child.weight, child.bias))
    nll, n = 0.0, 0
    with torch.inference_mode():
        for ids in prompts:
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
            nll -= float(logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum())
            n += len(ids) - 1
    return math.exp(nll / n)


@pytest.mark.skipif("fbgemm" not in torch.backends.quantized.supported_engines,
                    reason="this torch build has no fbgemm engine")
def test_bench_accuracy_int8_on_a_tiny_model(make_tiny_checkpoint, tmp_path, capsys):
    model = make_tiny_checkpoint("llama")
    prompts = [[5, 9, 14, 3, 27, 8, 11, 40, 2, 19, 33], [7, 7, 21, 4, 16, 30], [12, 50, 3, 9, 9, 28, 6, 17]]
    data = tmp_path / "w.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "max_tokens": 6}) + "\n" for p in prompts))
    out = tmp_path / "acc.json"
    rc = main(["bench", "accuracy", "--model", model, "--dataset", str(data), "--output-len", "6",
               "--quantization", "int8", "--output-json", str(out), *ENGINE_FLAGS])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["num_requests"] == 3 and res["num_scored_tokens"] == 10 + 5 + 7
    # The reference side is the float32 engine, whose prompt log-probs are transformers'.
    assert res["reference_perplexity"] == pytest.approx(_hf_perplexity(model, prompts), rel=1e-4)
    # The candidate side is transformers with int8 linear layers, each prompt alone; the engine
    # batches the three prompts, and int8 results do not depend on the batch.
    assert res["perplexity"] == pytest.approx(_hf_perplexity(model, prompts, int8=True), rel=1e-3)
    assert res["perplexity"] != res["reference_perplexity"]
    assert 0 < res["mean_abs_logprob_diff"] < 0.5
    assert 0.8 < res["perplexity_ratio"] < 1.25
    assert res["top1_agreement"] >= 0.6
    assert 0 <= res["mean_greedy_prefix_tokens"] <= 6 and 0 <= res["greedy_exact_fraction"] <= 1
    assert res["quantization"] == "int8"
    assert "perplexity_ratio" in capsys.readouterr().out


@pytest.mark.parametrize("flags", [["--dtype", "float32"], [], ["--quantization", "gguf"]])
def test_bench_accuracy_refuses_the_reference_itself(make_tiny_checkpoint, capsys, monkeypatch, flags):
    # dtype "auto" is float32 on a path without bf16 instructions (bfloat16 where the CPU has them).
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", "portable")
    rc = main(["bench", "accuracy", "--model", make_tiny_checkpoint("llama"), *flags,
               "--dataset", "random", "--num-prompts", "2", *ENGINE_FLAGS])
    assert rc == 2
    assert "reference" in capsys.readouterr().err
