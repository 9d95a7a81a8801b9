"""Weight-only int8 / int4 layers (pagedllm/layers/weight_only.py): quantization by hand, each
layer's output against a float reference built from the same dequantized weights, and the engine
mode end to end on a tiny Gemma 3 against transformers with the same weights and roundings."""

import pytest
import torch
import torch.nn.functional as F

from pagedllm.config import ModelConfig
from pagedllm.layers.int8_gemm import TORCH_KERNEL, VNNI_KERNEL, missing_vnni_flags
from pagedllm.layers.linear import lm_head_logits
from pagedllm.layers.weight_only import (HEAD_MODE, INT4_GROUP_SIZE, INT4_WEIGHT_ONLY, INT8_WEIGHT_ONLY,
                                         Int4WeightOnlyLinear, Int8WeightOnlyLinear, make_weight_only_layer,
                                         quantize_int4_groupwise, quantize_int8_per_channel, quantize_weight_only,
                                         weight_only_available)

MODES = [INT8_WEIGHT_ONLY, INT4_WEIGHT_ONLY]


@pytest.mark.parametrize("mode", MODES)
def test_kernels_exist_and_probe_succeeds(mode):
    """torch 2.13's CPU build has both kernels; the probe must pass (a broken probe fails here)."""
    assert weight_only_available(mode)


def test_int8_per_channel_by_hand():
    w = torch.tensor([[1.27, -0.5, 0.0], [0.0, 0.0, 0.0], [-2.54, 1.0, 0.013]])
    q, s = quantize_int8_per_channel(w)
    torch.testing.assert_close(s, torch.tensor([0.01, 1.0, 0.02]))   # max|row| / 127; zero row -> 1
    assert q.dtype == torch.int8
    assert q.tolist() == [[127, -50, 0], [0, 0, 0], [-127, 50, 1]]


def test_int4_groupwise_by_hand():
    # One row, two groups of 4 columns: [0, 1.5, 0.75, 0.1] -> min 0, max 1.5, scale 0.1;
    # [-3, -3, -3, -3] (constant) -> scale 1, q 0.
    w = torch.tensor([[0.0, 1.5, 0.75, 0.1, -3.0, -3.0, -3.0, -3.0]])
    q, s, z = quantize_int4_groupwise(w, group_size=4)
    torch.testing.assert_close(s, torch.tensor([[0.1, 1.0]]))
    torch.testing.assert_close(z, torch.tensor([[0.8, 5.0]]))        # min + 8 * scale
    assert q.tolist() == [[0, 15, 8, 1, 0, 0, 0, 0]]                   # round((w - min) / scale)
    dq = (q.float() - 8) * s.repeat_interleave(4, 1) + z.repeat_interleave(4, 1)
    torch.testing.assert_close(dq, torch.tensor([[0.0, 1.5, 0.8, 0.1, -3.0, -3.0, -3.0, -3.0]]))
    with pytest.raises(ValueError, match="group_size"):
        quantize_int4_groupwise(torch.zeros(2, 40), group_size=32)


def _layer(mode, w, b, dtype):
    return Int8WeightOnlyLinear(w, b, dtype) if mode == INT8_WEIGHT_ONLY else \
        Int4WeightOnlyLinear(w, b, INT4_GROUP_SIZE, dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m", [1, 3, 8, 33])
@pytest.mark.parametrize("shape", [(48, 64), (96, 128), (50, 64)])
def test_layer_matches_dequantized_reference_float32(mode, m, shape):
    """In float32 compute the kernel is the float product with the dequantized weight (tight)."""
    torch.manual_seed(m)
    w, b = torch.randn(*shape) * 0.05, torch.randn(shape[0])
    x = torch.randn(m, shape[1])
    layer = _layer(mode, w, b, torch.float32)
    w_dq = layer.dequantized_weight()
    torch.testing.assert_close(layer(x), F.linear(x, w_dq, b), rtol=1e-5, atol=1e-5)
    # The dequantized weight is within half a quantization step of the original.
    if mode == INT8_WEIGHT_ONLY:
        step = quantize_int8_per_channel(w)[1][:, None]
    else:
        step = quantize_int4_groupwise(w)[1].repeat_interleave(INT4_GROUP_SIZE, 1)
    assert bool(((w_dq - w).abs() <= step / 2 * 1.001 + 1e-7).all())
    assert float((w_dq - w).abs().max()) > 0   # really quantized


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m", [1, 4, 8])
def test_layer_matches_dequantized_reference_bfloat16(mode, m):
    """The default compute dtype: input rounded to bfloat16, float32 accumulation, output rounded
    to bfloat16. Reference: the same input rounding, F.linear in float32 with the dequantized weight,
    then the same output rounding; they may differ by one bfloat16 step where the float32 sums
    differ in their last bits."""
    torch.manual_seed(10 + m)
    w = torch.randn(96, 128) * 0.05
    x = torch.randn(m, 128) * 3
    layer = _layer(mode, w, None, torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.float32
    want = F.linear(x.bfloat16().float(), layer.dequantized_weight()).bfloat16().float()
    one_step = want.abs() * 2.0 ** -7 + 1e-6                           # one bfloat16 ulp (8-bit mantissa)
    assert bool(((y - want).abs() <= one_step).all())
    assert float((y == want).float().mean()) > 0.9


@pytest.mark.parametrize("mode", MODES)
def test_rows_do_not_depend_on_the_batch(mode):
    torch.manual_seed(0)
    layer = _layer(mode, torch.randn(64, 64) * 0.1, torch.randn(64), torch.bfloat16)
    x = torch.randn(6, 64) * torch.logspace(-2, 2, 6)[:, None]
    batched = layer(x)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
    torch.testing.assert_close(batched, alone, rtol=0, atol=0)


def _cpu_isa_for(int8_kernel):
    """The ``cpu_isa`` that makes ``quantize_weight_only`` pick ``int8_kernel`` here (skips, naming the
    missing flag, where the VNNI kernel cannot run)."""
    if int8_kernel == TORCH_KERNEL:
        return "avx2"
    missing = missing_vnni_flags()
    if missing:
        pytest.skip(f"the VNNI int8 kernel needs the CPU flags {missing}")
    return "auto"


@pytest.mark.parametrize("int8_kernel", [TORCH_KERNEL, VNNI_KERNEL])
@pytest.mark.parametrize("mode", MODES)
def test_quantize_weight_only_replaces_linears_and_the_tied_head(mode, int8_kernel, tied_toy):
    """A tied embedding [50, 64] and one ``proj`` linear [32, 64] with bias."""
    torch.manual_seed(0)
    model = tied_toy(out_features=32, hidden=64)
    w_proj, b_proj = model.model.proj.weight.detach().clone(), model.model.proj.bias.detach().clone()
    w_head = model.model.embed_tokens.weight.detach().clone()
    delta = quantize_weight_only(model, mode, _cpu_isa_for(int8_kernel))
    proj, head = model.model.proj, model.packed_lm_head
    assert type(proj) is (Int8WeightOnlyLinear if mode == INT8_WEIGHT_ONLY else Int4WeightOnlyLinear)
    assert type(head) is Int8WeightOnlyLinear                            # the head is int8 in both modes
    assert head.kernel == int8_kernel
    assert torch.equal(model.model.embed_tokens.weight, w_head)          # the lookup keeps float weights
    freed = 32 * 64 * 4 + 32 * 4                                         # the float proj weight and bias
    if int8_kernel == TORCH_KERNEL:   # int8 codes + one bfloat16 scale per row, bias kept in float32
        int8_proj, head_bytes = 32 * 64 + 32 * 2 + 32 * 4, 50 * 64 + 50 * 2
    else:   # codes in blocks of 16 rows (50 -> 64 for the head), int32 row sums, float32 scales and bias
        int8_proj, head_bytes = 32 * 64 + 32 * 4 + 32 * 4 + 32 * 4, 64 * 64 + 64 * 4 + 50 * 4
    if mode == INT8_WEIGHT_ONLY:
        assert delta == int8_proj - freed + head_bytes
    else:                          # 4 bits per weight + (scale, zero) in bfloat16 per 32 columns; int8 head
        assert delta == (32 * 32 + 32 * 2 * 2 * 2 + 32 * 4) - freed + head_bytes
    x = torch.randn(3, 64)
    for layer, got, bias in ((proj, proj(x), b_proj), (head, lm_head_logits(model, x), None)):
        w_dq = layer.dequantized_weight()
        if getattr(layer, "kernel", TORCH_KERNEL) == TORCH_KERNEL:    # bfloat16 input row, float sums, bfloat16 output
            torch.testing.assert_close(got, F.linear(x.bfloat16().float(), w_dq, bias), rtol=2 ** -7, atol=1e-4)
        else:   # 16-bit fixed-point row: each element errs by at most max|x| / 65534 (+ float32 rounding)
            bound = x.abs().amax(1, keepdim=True) / 65534 * w_dq.abs().sum(1) + 1e-5
            assert bool(((got - F.linear(x, w_dq, bias)).abs() <= bound).all())
    # And close to the float layer, within what the weights' rounding allows.
    tol = 0.02 if mode == INT8_WEIGHT_ONLY else 0.3
    torch.testing.assert_close(proj(x), F.linear(x, w_proj, b_proj), rtol=0, atol=tol)


def test_weight_only_values_are_validated(tied_toy):
    for mode in MODES:
        assert ModelConfig(quantization=mode).quantization == mode
        assert ModelConfig(quantization=mode, dtype="bfloat16").dtype == "bfloat16"
        with pytest.raises(ValueError, match="dtype"):
            ModelConfig(quantization=mode, dtype="float16")
        with pytest.raises(ValueError, match="CPU"):
            ModelConfig(quantization=mode, device="cuda")
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        quantize_weight_only(tied_toy(out_features=32, hidden=64).half(), INT8_WEIGHT_ONLY)
    with pytest.raises(ValueError, match="quantization"):
        make_weight_only_layer("int2_weight_only", torch.zeros(4, 32), None, torch.float32)


def _hf_weight_only_greedy(model_dir, mode, prompts, max_new_tokens, int8_kernel):
    """transformers greedy decoding with every linear layer (and the tied head, in ``HEAD_MODE``)
    replaced by the float product of the same dequantized weights, input and output rounded to bfloat16 as the
    torch kernels do; with the VNNI int8 kernel, int8 layers are that kernel itself (its arithmetic is
    tested against a float64 reference in tests/layers/test_int8_gemm.py)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    head = model.get_output_embeddings()

    def patch(module):
        layer = make_weight_only_layer(HEAD_MODE[mode] if module is head else mode, module.weight, module.bias,
                                       torch.bfloat16, int8_kernel)
        if getattr(layer, "kernel", TORCH_KERNEL) == VNNI_KERNEL:
            module.forward = layer
            return
        w_dq = layer.dequantized_weight()
        bias = None if module.bias is None else module.bias.detach().float()
        module.forward = lambda x: F.linear(x.bfloat16().float(), w_dq).bfloat16().float() + \
            (0 if bias is None else bias)

    for module in list(model.modules()):
        if isinstance(module, torch.nn.Linear):
            patch(module)
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


@pytest.mark.parametrize("int8_kernel", [TORCH_KERNEL, VNNI_KERNEL])
@pytest.mark.parametrize("mode", MODES)
def test_engine_greedy_equals_transformers_with_the_same_quantized_weights(mode, int8_kernel, make_tiny_checkpoint):
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    path = make_tiny_checkpoint("gemma3")
    prompts = [[5, 17, 42, 99, 7], [200, 3, 3, 150, 61, 88, 12, 9, 250], [33]]
    llm = LLM(path, dtype="float32", quantization=mode, max_model_len=128, seed=0,
              kv_cache_memory_bytes=8 << 20, cpu_isa=_cpu_isa_for(int8_kernel))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == _hf_weight_only_greedy(path, mode, prompts, 12, int8_kernel)
    # The engine really ran the quantized layers (every linear and the tied head).
    model = llm.llm_engine.executor.driver_worker.model_runner.model
    kinds = {type(m) for m in model.modules() if isinstance(m, (Int8WeightOnlyLinear, Int4WeightOnlyLinear))}
    assert kinds == {Int8WeightOnlyLinear, Int4WeightOnlyLinear} - ({Int4WeightOnlyLinear} if mode == INT8_WEIGHT_ONLY else set())
    assert type(model.packed_lm_head) is Int8WeightOnlyLinear
    assert model.packed_lm_head.kernel == int8_kernel
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
