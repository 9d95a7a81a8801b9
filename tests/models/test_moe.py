"""Mixture of experts (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE) against transformers on tiny random
checkpoints built here from transformers' config classes (8 experts, top 2; float32 unless said):
greedy tokens and per-step logits, routing token for token (which experts, which weights), the
MoE block's output split over two tensor ranks (experts sliced, or whole experts per rank), the
engine at tensor_parallel_size=2 with and without ``enable_expert_parallel``, and bf16 / int8
weight-only runs."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.parallel_state import ParallelContext

MAX_NEW = 10
# float32 logits of the engine against transformers' (same weights, different sum orders).
LOGIT_ATOL = 1e-4
FAMILIES = ["qwen3_moe", "qwen3_moe_norm", "qwen2_moe", "mixtral", "olmoe"]


def _config(family: str, vocab: int):
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, initializer_range=0.3, bos_token_id=2, eos_token_id=1, pad_token_id=0,
                  num_experts_per_tok=2, tie_word_embeddings=False)
    if family.startswith("qwen3_moe"):   # layer 1 dense (mlp_only_layers); norm_topk_prob both ways
        return Qwen3MoeConfig(**common, head_dim=32, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                              norm_topk_prob=family == "qwen3_moe_norm", mlp_only_layers=[1])
    if family == "qwen2_moe":            # shared expert with its sigmoid gate; layer 0 dense
        return Qwen2MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                              shared_expert_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[0])
    if family == "mixtral":
        return MixtralConfig(**common, intermediate_size=32, num_local_experts=8)
    if family == "olmoe":                # full-width q/k norms, q/k/v clamped
        return OlmoeConfig(**common, intermediate_size=32, num_experts=8, clip_qkv=4.0)
    raise ValueError(family)


@pytest.fixture(scope="module")
def moe_checkpoint(tiny_tokenizer_dir, save_tiny_checkpoint):
    """Factory: family -> folder (config.json, model.safetensors, the tiny tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache: dict[str, str] = {}

    def make(family: str) -> str:
        if family not in cache:
            vocab = len(AutoTokenizer.from_pretrained(tiny_tokenizer_dir))
            torch.manual_seed(1234)
            model = AutoModelForCausalLM.from_config(_config(family, vocab), dtype=torch.float32)
            cache[family] = save_tiny_checkpoint(model, family)
        return cache[family]

    return make


def _prompts(n: int = 4, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(length)] for length in (5, 23, 1, 40)[:n]]


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_greedy_and_logits(path: str, prompts: list[list[int]]):
    """transformers' greedy tokens (each prompt alone) and the logits [MAX_NEW, V] that chose them."""
    hf = _hf(path)
    tokens, logits = [], []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, min_new_tokens=0,
                            do_sample=False, eos_token_id=None, pad_token_id=0)[0]
            tokens.append(y[len(ids):].tolist())
            logits.append(hf(y[None, :-1]).logits[0, len(ids) - 1:])            # positions that chose them
    return tokens, logits


def _record_logits(llm: LLM) -> list[torch.Tensor]:
    """Every ``compute_logits`` output of the engine's (in-process) model, in call order."""
    model = llm.llm_engine.executor.driver_worker.model
    seen, original = [], model.compute_logits

    def recording(hidden_states):
        out = original(hidden_states)
        seen.append(out.detach().clone())
        return out

    model.compute_logits = recording
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_and_logits_equal_transformers(family, moe_checkpoint):
    path = moe_checkpoint(family)
    prompts = _prompts()
    want_tokens, want_logits = _hf_greedy_and_logits(path, prompts)
    llm = LLM(path, dtype="float32", max_model_len=128, seed=0, kv_cache_memory_bytes=16 << 20,
              exact_greedy_head="off")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want_tokens
    # Logits: one prompt alone, so each compute_logits call is one row of one step.
    seen = _record_logits(llm)
    llm.generate({"prompt_token_ids": prompts[3]}, params, use_tqdm=False)
    got = torch.cat(seen)                                                           # [MAX_NEW, V]
    diff = (got - want_logits[3][:, : got.shape[1]]).abs().max().item()
    assert got.shape == want_logits[3].shape and diff < LOGIT_ATOL, diff


def _moe_layer_io(path: str, ids: list[int]):
    """transformers' per MoE layer: the block's input [T, H], the router's (weights, experts) and the
    block's output [T, H]."""
    hf = _hf(path)
    records: dict[int, dict] = {}
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        block = getattr(layer, "block_sparse_moe", None) or layer.mlp
        if not hasattr(block, "gate") or not hasattr(block, "experts"):
            continue
        rec = records.setdefault(i, {})
        hooks.append(block.register_forward_hook(
            lambda m, args, out, rec=rec: rec.update(x=args[0][0].clone(), y=out[0].clone())))
        hooks.append(block.gate.register_forward_hook(
            lambda m, args, out, rec=rec: rec.update(weights=out[1].float().clone(), experts=out[2].clone())))
    with torch.inference_mode():
        hf(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return records


def _build(path: str, ctx: ParallelContext | None = None):
    from pagedllm.config import ModelConfig
    from pagedllm.loaders import iterate_weights, load_config
    from pagedllm.worker.worker import build_model

    config = ModelConfig.from_hf_config(load_config(path), model_folder=path, dtype="float32")
    return build_model(config, iterate_weights(path), torch.float32, torch.device("cpu"), ctx)


@pytest.mark.parametrize("family", FAMILIES)
def test_routing_and_block_output_equal_transformers_also_split_over_two_ranks(family, moe_checkpoint):
    """Which experts and which weights, token for token; the block's output alone, summed over two
    tensor ranks with every expert sliced, and summed over two ranks holding 4 whole experts each."""
    from pagedllm.layers.fused_moe import select_experts

    path = moe_checkpoint(family)
    ids = _prompts(4, seed=5)[3]
    ref = _moe_layer_io(path, ids)
    assert ref, "no MoE layer found in the transformers model"
    single = _build(path)
    split = {ep: [_build(path, ParallelContext(tp_rank=r, tp_size=2, enable_expert_parallel=ep)) for r in (0, 1)]
             for ep in (False, True)}
    with torch.inference_mode():
        for i, rec in ref.items():
            block = single.model.layers[i].mlp
            weights, experts = select_experts(block.gate(rec["x"]), block.experts.top_k, block.experts.renormalize)
            assert torch.equal(experts, rec["experts"]), i
            assert (weights - rec["weights"]).abs().max().item() < 1e-6, i
            assert (block(rec["x"]) - rec["y"]).abs().max().item() < 1e-5, i
            for ep, ranks in split.items():
                parts = [m.model.layers[i].mlp.partial(rec["x"]) for m in ranks]
                assert (parts[0] + parts[1] - rec["y"]).abs().max().item() < 1e-5, (i, ep)
                for t in (0, 7):   # one token alone (the batch-1 decode path)
                    one = [m.model.layers[i].mlp.partial(rec["x"][t:t + 1]) for m in ranks]
                    assert (one[0] + one[1] - rec["y"][t:t + 1]).abs().max().item() < 1e-5, (i, ep, t)
            assert (block(rec["x"][3:4]) - rec["y"][3:4]).abs().max().item() < 1e-5, i
            # Expert parallelism: rank 0 holds experts 0-3 and contributes only where a token chose one.
            held = split[True][0].model.layers[i].mlp.experts
            assert (held.expert_start, held.num_local_experts) == (0, 4)
            if not block.has_shared_expert:
                untouched = ~(experts < 4).any(dim=1)
                assert torch.all(split[True][0].model.layers[i].mlp.partial(rec["x"])[untouched] == 0)


@pytest.mark.parametrize("dtype,quantization", [("bfloat16", None), ("float32", "int8_weight_only"),
                                                ("bfloat16", "int8_weight_only")])
def test_bf16_and_int8_weight_only_follow_transformers(dtype, quantization, moe_checkpoint):
    """Lower precision: the experts run through the kernel layers (one per expert and part); the
    greedy tokens follow float32 transformers' until the first difference, where transformers' token
    is among the engine's top 5."""
    from pagedllm.layers.fused_moe import FusedMoE

    path = moe_checkpoint("qwen2_moe")
    prompts = _prompts()
    want, _ = _hf_greedy_and_logits(path, prompts)
    llm = LLM(path, dtype=dtype, quantization=quantization, max_model_len=128, seed=0,
              kv_cache_memory_bytes=16 << 20)
    moes = [m for m in llm.llm_engine.executor.driver_worker.model.modules() if isinstance(m, FusedMoE)]
    assert moes and all(m.expert_layers is not None and len(m.expert_layers) == 8 for m in moes)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5),
                        use_tqdm=False)
    for out, ref in zip(outs, want):
        got = out.outputs[0].token_ids
        first = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        if first is not None:
            assert ref[first] in out.outputs[0].logprobs[first], (first, got, ref)


@pytest.mark.parametrize("mode", ["int8_weight_only", "bfloat16"])
def test_grouped_kernel_experts_equal_a_per_token_reference(mode, moe_checkpoint):
    """The grouped path through per-expert kernel layers (int8 weight-only, or the bf16 GEMM / oneDNN)
    equals a per-token loop over the same weights (int8: the dequantized ones) within the kernels'
    activation rounding (bf16: 2^-8 relative). bf16 runs whichever bf16 GEMM the CPU has (AMX,
    AVX-512 BF16, AVX2, or oneDNN)."""
    import torch.nn.functional as F

    from pagedllm.layers.fused_moe import select_experts
    from pagedllm.layers.bf16_gemm import Bf16Linear, bf16_module
    from pagedllm.layers.linear import PackedLinear, onednn_linear_available, packed_kernel_for
    from pagedllm.layers.weight_only import WEIGHT_ONLY_COMPUTE_DTYPE, make_weight_only_layer

    model = _build(moe_checkpoint("qwen2_moe"))
    experts = model.model.layers[1].mlp.experts
    dtype = torch.float32 if mode == "int8_weight_only" else torch.bfloat16
    if mode == "bfloat16":
        experts.to(dtype)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    weights, ids = select_experts(model.model.layers[1].mlp.gate.float()(x.float()), 2, experts.renormalize)
    w13, w2 = experts.w13_weight.detach().clone(), experts.w2_weight.detach().clone()
    if mode == "int8_weight_only":
        made = experts.replace_expert_layers(lambda w, b: make_weight_only_layer(mode, w, b, WEIGHT_ONLY_COMPUTE_DTYPE))
        w13 = torch.stack([layers[0].dequantized_weight() for layers in experts.expert_layers])
        w2 = torch.stack([layers[1].dequantized_weight() for layers in experts.expert_layers])
    else:
        kernel, _ = packed_kernel_for(torch.bfloat16, torch.device("cpu"))
        module = bf16_module(kernel) if kernel not in ("onednn", "torch") else None
        if module is None and not onednn_linear_available(torch.bfloat16):
            pytest.skip(f"no bf16 GEMM here ({kernel}): needs avx2+fma, or oneDNN's bf16 (avx512bw avx512vl avx512dq)")
        made = experts.replace_expert_layers(
            (lambda w, b: Bf16Linear(w, b, module)) if module is not None else (lambda w, b: PackedLinear(w, b, 16)))
    assert made == 16 and experts.w13_weight is None
    with torch.inference_mode():
        got = experts.apply_experts(x, weights, ids).float()
        want = torch.zeros(16, 64)
        for t in range(16):                                   # the per-token reference
            for j in range(2):
                e = int(ids[t, j])
                gate, up = F.linear(x[t].float(), w13[e].float()).chunk(2)
                want[t] += weights[t, j] * F.linear(F.silu(gate) * up, w2[e].float())
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() < 2e-2 * scale, ((got - want).abs().max().item(), scale)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,expert_parallel", [("qwen2_moe", False), ("qwen2_moe", True), ("olmoe", True)],
                         ids=["qwen2_moe-tp2", "qwen2_moe-tp2-ep", "olmoe-tp2-ep"])
def test_two_ranks_equal_transformers(family, expert_parallel, moe_checkpoint):
    """The engine at tensor_parallel_size=2 (two worker processes, gloo), experts sliced or placed
    whole: greedy tokens equal transformers'."""
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine

    path = moe_checkpoint(family)
    prompts = _prompts()
    want, _ = _hf_greedy_and_logits(path, prompts)
    engine = LLMEngine(EngineArgs(model=path, dtype="float32", max_model_len=128, seed=0, block_size=8,
                                  kv_cache_memory_bytes=4 << 20, tensor_parallel_size=2, cpu_threads_per_rank=1,
                                  enable_expert_parallel=expert_parallel))
    try:
        assert len(engine.executor.processes) == 2
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        got = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    got[o.request_id] = o.outputs[0].token_ids
    finally:
        engine.shutdown()
    assert [got[f"r{i}"] for i in range(len(prompts))] == want


def test_expert_parallel_sizes_are_checked_before_loading(moe_checkpoint):
    with pytest.raises(ValueError, match="enable_expert_parallel: tensor_parallel_size=3 must divide the model's 8"):
        LLM(moe_checkpoint("mixtral"), tensor_parallel_size=3, enable_expert_parallel=True)
