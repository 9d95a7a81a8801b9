"""The fused C++ CPU ops (``layers/fused_ops.py``) against the eager torch code they replace.

Tolerances, and why:
- float32: the norms sum x^2 in another order than torch's reduction; a float32 sum of hundreds
  of squares is itself only good to several ulp, so the two inverse rms values may differ by a few
  ulp, and the two multiplies after it round again: each output is allowed 8 ulp (measured: at
  most 5; 60-100% of the elements bitwise equal) of the magnitude of the terms that
  formed it (for a residual add with cancellation, the larger addend's magnitude, since an error
  of a few ulp in ``post_norm(h)`` is that many ulp of ``|post_norm(h)|``, not of the small sum).
  The activations use torch's formula, vector tanh / exp and FMA, so on rows of whole vectors
  (the real models' sizes) of an AVX2 / AVX-512 build they must be bitwise equal; RoPE's products and sums are rounded where
  torch rounds them, so it differs only through the norm before it.
- bfloat16: the rounding points are the eager code's, so an output differs only where a float32
  value a few ulp off lies across a bfloat16 rounding boundary: at most one bfloat16 ulp (of the
  same magnitude as above). The fraction of bitwise-equal elements is printed (``-s``) and must be
  at least 99%.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers import fused_ops
from pagedllm.layers.rotary import RotaryEmbedding, apply_rotary
from cpp_build import require_built_extension

ROWS = (1, 7, 64, 300)
DTYPES = (torch.float32, torch.bfloat16)
EPS = 1e-6


@pytest.fixture(scope="module")
def ops():
    return require_built_extension(fused_ops.load_fused_ops, "the fused ops (the eager ops would run instead)")


def test_fused_ops_build_here(ops):
    """Where a compiler exists the extension must build, else every test here would pass vacuously."""
    assert ops.compiled_isas()[0] in ("avx512", "avx2", "portable")
    assert fused_ops.EXTENSION.build_directory().name == fused_ops.EXTENSION.name()


def _ulp(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One ulp of ``dtype`` at magnitude ``scale`` (float64)."""
    s = scale.double().abs().clamp_min(torch.finfo(dtype).tiny)
    return torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(s)))


def check(name, got, want, scale=None):
    """Assert the tolerance of the module docstring; return the fraction of bitwise-equal elements."""
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = want.abs() if scale is None else torch.maximum(want.abs().double(), scale.abs().double())
    ulps = 8 if want.dtype == torch.float32 else 1
    err = (got.double() - want.double()).abs()
    bound = ulps * _ulp(scale, want.dtype)
    bad = err > bound
    assert not bad.any(), f"{name}: {int(bad.sum())} elements off by more than {ulps} ulp, e.g. " \
                          f"{got[bad][:4].tolist()} vs {want[bad][:4].tolist()}"
    equal = (got == want).double().mean().item()
    print(f"{name}: {100 * equal:.2f}% bitwise equal")
    if want.dtype == torch.bfloat16:
        assert equal >= 0.99, f"{name}: only {100 * equal:.2f}% bitwise equal"
    return equal


def eager_gemma_norm(x, w1):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS) * w1).type_as(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", [640, 72])   # the default model's, and one with a partial vector
def test_gemma_rms_norm_and_residual_step(ops, rows, dtype, hidden):
    g = torch.Generator().manual_seed(rows * 1000 + hidden)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    h = (torch.randn(rows, hidden, generator=g) * 5).to(dtype)
    w_post = 1.0 + torch.randn(hidden, generator=g) * 0.3
    w_pre = 1.0 + torch.randn(hidden, generator=g) * 0.3

    check(f"gemma_rms_norm {rows}x{hidden} {dtype}", ops.gemma_rms_norm(x, w_post, EPS), eager_gemma_norm(x, w_post))

    post = eager_gemma_norm(h, w_post)
    new_residual = x + post
    want_x = eager_gemma_norm(new_residual, w_pre)
    got_residual, got_x = ops.gemma_add_rms_norm(h, x, w_post, w_pre, EPS, EPS)
    term = torch.maximum(x.abs(), post.abs()).double()
    check(f"gemma_add_rms_norm residual {rows}x{hidden} {dtype}", got_residual, new_residual, term)
    r = torch.rsqrt(new_residual.double().pow(2).mean(-1, keepdim=True) + EPS)
    check(f"gemma_add_rms_norm x {rows}x{hidden} {dtype}", got_x, want_x, term * r * w_pre.abs().double())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 1, 256), (3, 3, 40)])
def test_gemma_qk_norm_rope(ops, rows, dtype, heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(rows + head_dim)
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=g) * 2).to(dtype)
    qw1 = 1.0 + torch.randn(head_dim, generator=g) * 0.3
    kw1 = 1.0 + torch.randn(head_dim, generator=g) * 0.3
    cos, sin = RotaryEmbedding(head_dim, 10000.0)(torch.randint(0, 3000, (rows,), generator=g), dtype)

    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    qn = eager_gemma_norm(q.reshape(rows, heads, head_dim), qw1)
    kn = eager_gemma_norm(k.reshape(rows, kv_heads, head_dim), kw1)
    want_q, want_k = apply_rotary(qn, kn, cos, sin)

    got = qkv.clone()
    ops.gemma_qk_norm_rope_(got, qw1, kw1, cos, sin, heads, kv_heads, EPS, EPS)
    gq, gk, gv = got.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    assert torch.equal(gv, v), "v must be left as it was"

    def terms(n, w1):  # |n * cos| + |rot(n) * sin|: the addends of each output
        half = head_dim // 2
        rot = torch.cat((n[..., half:], n[..., :half]), dim=-1)
        return (n.double() * cos.double()).abs() + (rot.double() * sin.double()).abs()
    check(f"qk_norm_rope q {rows} {dtype}", gq.reshape(want_q.shape), want_q, terms(qn, qw1))
    check(f"qk_norm_rope k {rows} {dtype}", gk.reshape(want_k.shape), want_k, terms(kn, kw1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("inter", [2048, 40])
def test_gated_activations_are_bitwise_torch(ops, rows, dtype, inter):
    g = torch.Generator().manual_seed(rows + inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 3).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    cases = {"gelu_tanh_and_mul": (ops.gelu_tanh_and_mul(gate_up), F.gelu(gate, approximate="tanh") * up),
             "silu_and_mul": (ops.silu_and_mul(gate_up), F.silu(gate) * up)}
    for name, (got, want) in cases.items():
        if inter % 64 == 0 and ops.compiled_isas()[0] != "portable":
            # whole vectors: torch's formula, SLEEF tanh / exp and FMA, bit for bit
            assert torch.equal(got, want), name
        else:  # torch's tail loops may split a row elsewhere than ours, and a portable build
            # (no AVX2) has std::tanh / exp per lane; near act(x) = 0 the 1 + tanh / exp cancels,
            # so the ulp is that of |gate * up| (the terms' magnitude)
            check(f"{name} {rows}x{inter} {dtype}", got, want, (gate.double() * up.double()).abs())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_llama_rms_norm(ops, rows, dtype):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    w = (1.0 + torch.randn(576, generator=g) * 0.3).to(dtype)
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)
    # The weight multiply follows the rounded normalised value: one ulp there is |w| ulp here.
    check(f"rms_norm {rows} {dtype}", ops.rms_norm(x, w, EPS), w * normed, 2 * normed.double().abs() * w.double().abs())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_llama_residual_step(ops, rows, dtype):
    g = torch.Generator().manual_seed(rows + 5)
    h = (torch.randn(rows, 576, generator=g) * 5).to(dtype)
    residual = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    w = (1.0 + torch.randn(576, generator=g) * 0.3).to(dtype)
    new_residual = residual + h
    n32 = new_residual.float()
    normed = (n32 * torch.rsqrt(n32.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)
    got_residual, got_x = ops.add_rms_norm(h, residual, w, EPS)
    assert torch.equal(got_residual, new_residual)   # one add, rounded once: bitwise
    check(f"add_rms_norm x {rows} {dtype}", got_x, w * normed, 2 * normed.double().abs() * w.double().abs())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("qk_norm", [False, True])   # Llama / Qwen2, Qwen3
def test_llama_qk_norm_rope(ops, rows, dtype, qk_norm):
    from pagedllm.layers.norm import RMSNorm

    heads, kv_heads, d = 4, 2, 64
    g = torch.Generator().manual_seed(rows + 11)
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * d, generator=g) * 2).to(dtype)
    cos, sin = RotaryEmbedding(d, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
                               )(torch.randint(0, 3000, (rows,), generator=g), dtype)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.reshape(rows, heads, d), k.reshape(rows, kv_heads, d)
    weights = (None, None)
    if qk_norm:
        q_norm, k_norm = RMSNorm(d, EPS).to(dtype), RMSNorm(d, EPS).to(dtype)
        with torch.no_grad():
            q_norm.weight.normal_(1.0, 0.3, generator=g)
            k_norm.weight.normal_(1.0, 0.3, generator=g)
        q, k = q_norm(q), k_norm(k)
        weights = (q_norm.weight.detach(), k_norm.weight.detach())
    want_q, want_k = apply_rotary(q, k, cos, sin)
    got = qkv.clone()
    ops.qk_norm_rope_(got, *weights, cos, sin, heads, kv_heads, d, EPS)
    gq, gk, gv = got.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    assert torch.equal(gv, v)
    if not qk_norm:  # RoPE alone rounds where torch rounds: bitwise
        assert torch.equal(gq.reshape(want_q.shape), want_q) and torch.equal(gk.reshape(want_k.shape), want_k)
        return

    def terms(n):
        half = d // 2
        rot = torch.cat((n[..., half:], n[..., :half]), dim=-1)
        return 2 * ((n.double() * cos.double()).abs() + (rot.double() * sin.double()).abs())
    check(f"qk_norm_rope_ q {rows} {dtype}", gq.reshape(want_q.shape), want_q, terms(q))
    check(f"qk_norm_rope_ k {rows} {dtype}", gk.reshape(want_k.shape), want_k, terms(k))


def test_dispatch_falls_back_to_eager(ops):
    """Off, float16, non-contiguous and (where present) CUDA tensors get no fused op."""
    x = torch.randn(4, 64)
    assert fused_ops.fused_ops_for(True, x) is ops
    assert fused_ops.fused_ops_for(False, x) is None
    assert fused_ops.fused_ops_for(True, x.half()) is None
    assert fused_ops.fused_ops_for(True, x.t()) is None
    assert fused_ops.fused_ops_for(True, x, x.bfloat16()) is None


# ------------------------------- a whole tiny Gemma 3 -------------------------------

class _Counting:
    """Wraps the extension and counts the calls of each op."""

    def __init__(self, module):
        self.module, self.calls = module, {}

    def __getattr__(self, name):
        fn = getattr(self.module, name)

        def wrapped(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return wrapped


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_gemma3_greedy_equal_fused_on_and_off(ops, make_tiny_checkpoint, monkeypatch, dtype):
    """Greedy tokens of a tiny random Gemma 3 are the same with the fused ops on and off, and the
    fused run does call every Gemma op (prefill and decode rows)."""
    from pagedllm import LLM, SamplingParams

    path = make_tiny_checkpoint("gemma3")
    prompts = [[5 + (7 * i + 3 * j) % 200 for j in range(n)] for i, n in enumerate([3, 40, 17, 1])]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    def run(mode):
        llm = LLM(path, dtype=dtype, max_model_len=128, kv_cache_memory_bytes=16 << 20, cpu_fused_ops=mode)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    counting = _Counting(ops)
    monkeypatch.setattr(fused_ops, "load_fused_ops", lambda: counting)
    fused = run("auto")
    assert {"gemma_rms_norm", "gemma_add_rms_norm", "gemma_qk_norm_rope_", "gelu_tanh_and_mul"} <= set(counting.calls)
    counting.calls.clear()
    eager = run("off")
    assert counting.calls == {}, "cpu_fused_ops='off' must not call the fused ops"
    assert fused == eager


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_llama_family_greedy_equal_fused_on_and_off(ops, make_tiny_checkpoint, monkeypatch, arch):
    """As for Gemma 3: a tiny random Llama / Qwen3 (q/k norms) gives the same greedy tokens in
    bfloat16 with the fused ops on and off, and the fused run calls every Llama op."""
    from pagedllm import LLM, SamplingParams

    path = make_tiny_checkpoint(arch)
    prompts = [[5 + (7 * i + 3 * j) % 200 for j in range(n)] for i, n in enumerate([3, 40, 1])]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(mode):
        llm = LLM(path, dtype="bfloat16", max_model_len=128, kv_cache_memory_bytes=16 << 20, cpu_fused_ops=mode)
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                              use_tqdm=False)]

    counting = _Counting(ops)
    monkeypatch.setattr(fused_ops, "load_fused_ops", lambda: counting)
    fused = run("auto")
    assert {"rms_norm", "add_rms_norm", "qk_norm_rope_", "silu_and_mul"} <= set(counting.calls)
    assert run("off") == fused


def test_gemma_norm_caches_one_plus_weight():
    """``1 + w`` is computed once after loading and bitwise the per-call value."""
    from pagedllm.layers.norm import GemmaRMSNorm

    norm = GemmaRMSNorm(64)
    with torch.no_grad():
        norm.weight.normal_(0, 0.5)
    assert norm.weight_plus_one is None
    x = torch.randn(3, 64)
    before = norm(x)
    norm.process_weights_after_loading()
    assert torch.equal(norm.weight_plus_one, 1.0 + norm.weight.float())
    assert torch.equal(norm(x), before)
    assert math.isclose(float(norm.scale()[0]), 1.0 + float(norm.weight[0]), rel_tol=1e-7)


def test_prepare_says_what_runs_and_config_validates(ops):
    """``prepare_fused_ops`` says whether the ops run and why (the kernel plan's row)."""
    from pagedllm.config import KernelConfig
    from pagedllm.engine.arg_utils import EngineArgs, add_engine_cli_args, engine_args_from_cli

    cpu = torch.device("cpu")
    assert fused_ops.prepare_fused_ops("auto", cpu, torch.bfloat16) == \
        (True, f"{ops.compiled_isas()[0]} code for bfloat16")
    assert fused_ops.prepare_fused_ops("off", cpu, torch.float32) == (False, "cpu_fused_ops='off'")
    assert fused_ops.prepare_fused_ops("auto", cpu, torch.float16) == \
        (False, "they take float32 or bfloat16, not torch.float16")
    with pytest.raises(ValueError, match="cpu_fused_ops must be one of"):
        KernelConfig(cpu_fused_ops="on")
    import argparse
    parser = argparse.ArgumentParser()
    add_engine_cli_args(parser)
    assert engine_args_from_cli(parser.parse_args(["--cpu-fused-ops", "off"])).cpu_fused_ops == "off"
    assert EngineArgs().cpu_fused_ops == "auto"


def test_build_failure_warns_once_and_runs_eager(ops, monkeypatch, caplog, make_tiny_checkpoint):
    """No compiler: the builder returns None with one WARNING naming the fallback, the start log
    says the eager ops run, and the model's tokens are those of cpu_fused_ops='off'."""
    import logging

    from torch.utils import cpp_extension

    from pagedllm import LLM, SamplingParams
    from pagedllm.platforms import cpu_extension

    def broken_load(*args, **kwargs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(cpu_extension, "_import_built", lambda name, build_dir: None)
    monkeypatch.setattr(cpp_extension, "load", broken_load)
    with caplog.at_level(logging.WARNING, logger=cpu_extension.__name__):
        assert cpu_extension.load_extension.__wrapped__(fused_ops.EXTENSION) is None
    assert "fused CPU ops unavailable (RuntimeError: no compiler); falling back to the eager torch ops" in caplog.text

    path = make_tiny_checkpoint("gemma3")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def run(mode):
        llm = LLM(path, dtype="float32", max_model_len=64, kv_cache_memory_bytes=8 << 20, cpu_fused_ops=mode)
        return llm.generate({"prompt_token_ids": [5, 9, 33, 7]}, params, use_tqdm=False)[0].outputs[0].token_ids

    eager = run("off")
    monkeypatch.setattr(fused_ops, "load_fused_ops", lambda: None)
    with caplog.at_level(logging.INFO, logger="pagedllm.worker.worker"):   # the kernel plan's table
        assert run("auto") == eager
    assert re.search(r"\n  fused CPU ops +off, eager torch ops +\(the extension could not be built \(see the warning "
                     r"above\)\)", caplog.text), caplog.text


NARROW_BUILDS = {"avx2": "x86-64-v3", "portable": "x86-64"}   # isa -> -march
# Run here and in the build processes, so both name the same extension (the name hashes the flags).
_NARROW_EXTENSION_SOURCE = """
from pagedllm.layers import fused_ops
from pagedllm.platforms.cpu_extension import CpuExtension, load_extension


def narrow_extension(isa, march):
    return CpuExtension(f"fused_ops_{isa}", fused_ops.SOURCE, f"fused CPU ops (-march={march})", "nothing",
                        extra_cflags=("-O3", f"-march={march}", "-fopenmp", "-ffp-contract=off"))
"""


def _narrow_isas(native_isa: str) -> dict[str, str]:
    """The narrower builds worth making here: those whose code path the native build did not
    compile (on an AVX2 machine the native build is the AVX2 path, which the tests above check)."""
    return {isa: march for isa, march in NARROW_BUILDS.items() if isa != native_isa}


def test_narrow_isas_leave_out_only_the_native_path():
    assert list(_narrow_isas("avx512")) == ["avx2", "portable"]
    assert list(_narrow_isas("avx2")) == ["portable"]
    assert list(_narrow_isas("portable")) == ["avx2"]


@pytest.fixture(scope="module")
def narrow_builds(ops):
    """Build the narrower extensions at once, each in its own process (a build is one
    single-threaded compiler run, ~20 s), so that the tests below load them from the cache.

    Returns:
        isa -> ``CpuExtension`` (what the processes built), for ``_narrow_isas``."""
    import platform
    import subprocess
    import sys

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"-march={'/'.join(NARROW_BUILDS.values())} are x86-64 targets; this machine is {platform.machine()}")
    wanted = _narrow_isas(ops.compiled_isas()[0])
    build = _NARROW_EXTENSION_SOURCE + "import sys\nsys.exit(load_extension(narrow_extension(*sys.argv[1:3])) is None)\n"
    procs = [subprocess.Popen([sys.executable, "-c", build, isa, march]) for isa, march in wanted.items()]
    assert [p.wait(timeout=600) for p in procs] == [0] * len(procs)
    scope: dict = {}
    exec(_NARROW_EXTENSION_SOURCE, scope)
    return {isa: scope["narrow_extension"](isa, march) for isa, march in wanted.items()}


@pytest.mark.slow
def test_narrower_builds_match_too(ops, narrow_builds):
    """The code paths the native build did not compile (of AVX2 and portable: what a CPU without
    AVX-512 builds with -march=native), built here with an explicit -march, pass the same op checks
    (about 20 s per build, once, built at once), the sampler's greedy argmax included."""
    from pagedllm.platforms.cpu_extension import load_extension

    assert set(narrow_builds) == set(NARROW_BUILDS) - {ops.compiled_isas()[0]}
    for isa, extension in narrow_builds.items():
        narrow = load_extension(extension)
        assert narrow is not None and narrow.compiled_isas() == [isa]
        for dtype in DTYPES:
            for rows in (1, 7):
                test_gemma_rms_norm_and_residual_step(narrow, rows, dtype, 72)
                test_gemma_qk_norm_rope(narrow, rows, dtype, 4, 1, 256)
                test_gated_activations_are_bitwise_torch(narrow, rows, dtype, 2048)
                test_llama_rms_norm(narrow, rows, dtype)
            for vocab in (17, 4096):
                test_greedy_argmax_equals_torch(narrow, dtype, vocab)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 255, 4096, 262144])
def test_greedy_argmax_equals_torch(ops, dtype, vocab):
    """``greedy_argmax`` is torch's ``max(dim).indices`` (= ``argmax``) exactly: first maximum,
    first NaN when a row has one, -0.0 == 0.0, all -inf -> 0; ties at every position of a vector."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(24, vocab, generator=g).to(dtype)
    x[1] = x[1].round()                                     # many ties (bf16 and float32)
    x[2] = float("-inf")
    x[3] = 0.0
    x[3, ::2] = -0.0
    x[4, vocab // 2:] = float("inf")                       # first inf in the second half
    x[5, (vocab * 3) // 4] = float("nan")
    x[6, vocab - 1] = float("nan")
    x[6, 0] = float("nan")
    x[7] = float("nan")
    x[8] = x[8].abs() * -1 - 1
    x[8, vocab - 1] = -0.5                                   # the maximum in the tail
    for r in range(9, 24):                                 # a tie of the row maximum at a random later index
        j = int(torch.randint(0, vocab, (1,), generator=g))
        x[r, j:] = torch.minimum(x[r, j:], x[r].max())
        x[r, j] = x[r].max()
    got = ops.greedy_argmax(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, x.max(dim=-1).indices)
    assert torch.equal(got, x.argmax(dim=-1))


def test_greedy_argmax_rejects_bad_input(ops):
    with pytest.raises(RuntimeError, match="vocab >= 1"):
        ops.greedy_argmax(torch.empty(2, 0))
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.greedy_argmax(torch.randn(8, 8).t())
