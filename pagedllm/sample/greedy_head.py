"""Exact greedy tokens from a cheaper LM head: a low-precision pass over the whole vocabulary, a
proven error bound, and an exact re-score of the few tokens the bound cannot rule out
(``KernelConfig.exact_greedy_head``, ``--exact-greedy-head {auto,off}``).

What is computed
----------------
For a hidden row ``x`` ([K] = hidden_size, the model dtype) and the model's head weight ``W``
([V, K], the tied embedding or the ``lm_head`` weight, float32 or bfloat16 *as stored*), the
reference score of token ``j`` is the exact real number ``r_j = sum_i x_i W[j, i]`` and the
reference token is ``argmax_j r_j``, the lowest index among equal maxima (torch's tie rule).
A final logit soft cap ``cap * tanh(r / cap)`` (Gemma 2) and any positive scaling are strictly
increasing functions of ``r_j``, so they map the maxima of ``r`` to the maxima of the capped
scores and keep their order: they do not change the exact argmax and are not applied here.

This is the argmax of the mathematically exact head. The full head (``compute_logits``) is
float32 or bfloat16 arithmetic and its argmax can differ from it where the top two exact scores
lie within the full head's own rounding error (float32: about 1e-6 relative, rare; bfloat16
logits: 2^-8 relative, i.e. 0.12 at a logit of 30, often). ``--exact-greedy-head off`` keeps the
full head's argmax.

Two passes (``ExactGreedyHead.argmax``)
---------------------------------------
1. Cheap scores ``c_j`` for every token from a low-precision copy ``W~`` of ``W`` (``kind``):

   - ``"bf16"``: ``W~ = bf16(W)`` packed for oneDNN (AVX-512 bf16 / AMX), float32 accumulation,
     bfloat16 output. Needs native bf16 (``platforms/cpu.py``).
   - ``"int8"``: ``W~[j] = q[j] * s_j`` with ``q`` int8 in [-127, 127] and ``s_j`` a bfloat16
     scale rounded *up* from ``max_i |W[j, i]| / 127`` (so nothing clips), through
     ``aten._weight_int8pack_mm`` (float32 FMAs over ``x_i * (q_ji * s_j)``, bfloat16 output;
     torch's ``int8mm_kernel.cpp``).

   - ``"int8_vnni"``: the same ``W~`` through the AVX-512 VNNI kernel of ``layers/int8_gemm.py``,
     which takes the row as it is (float32) in 16-bit fixed point and sums exactly in integers
     (its own bound below): no split, a quarter of the float32 head's bytes. Its window is wider
     (the int8 weight term), so it allows more candidates (``MAX_CANDIDATES_VNNI``) before a row
     falls back; the exact re-score of a few hundred 640-wide rows costs well under a millisecond.
   - ``"int8_avx2"``: the same kernel's AVX2 code (CPUs without VNNI): the same packed weight and
     the same 16-bit fixed-point row, summed exactly by ``vpmaddwd``; its scores go through the
     torch search of ``_argmax_two_pass`` (the fused C++ search is VNNI code). Hidden sizes up to
     ``INT8_AVX2_MAX_HIDDEN``.

   The first two kernels take bf16 activations. A float32 row is split into ``x_hi = bf16(x)`` and
   ``x_lo = bf16(x - x_hi)``, run as two kernel rows (at a decode step's few rows the head costs
   about the same for 2M rows as for M: it is memory bound), and ``c = fl32(c_hi + c_lo)``; the
   remainder ``x_res = x - x_hi - x_lo`` (about 2^-16 |x|) stays in the bound. Without the split
   the bf16 rounding of ``x`` (2^-8 |x|_1 max|W~_j|: ~6 logits on Gemma 3's rows, whose
   ``|x|_1`` is 700-1700) would make the bound useless. A bf16 row is its own ``x_hi``.

2. A bound ``|c_j - r_j| <= B_j`` for every token (derived below), candidates
   ``C = {j : c_j + B_j >= max_k (c_k - B_k)}`` (they include every exact maximum: for the exact
   best ``k*``, ``c_k* + B_k* >= r_k* >= r_k >= c_k - B_k`` for all ``k``), then the candidates
   are re-scored exactly (below) and the best taken, lowest index first. A row with more than
   ``MAX_CANDIDATES`` candidates, or a non-finite row, is returned as a fallback row: the caller
   runs the full head for it (today's path, not the exact argmax).

The bound
---------
Notation: ``u_o`` = 2^-8 (bf16's unit roundoff, 8 significant bits: the kernels' output
rounding), ``u`` = 2^-24 (float32), ``g`` = ``K u / (1 - K u)`` (Higham's gamma_K: float32
summation of K terms in any order, Higham 2002, lemma 3.1 / eq. 3.4); ``E_j = max_i |W~_ji - W_ji|``
and ``A_j = max_i |W~_ji|`` (measured exactly in float64 at load; ``E_j <= s_j / 2`` for int8,
``<= 2^-8 max|W_j|`` for bf16); per step, in float64: ``|x|_1``, ``|x_hi|_1 + |x_lo|_1``,
``|x_lo|_1``, ``|x_res|_1`` (exact: ``x_res`` is computed in float64 from bf16 / float32 values).
The products ``x_hi,i W~_ji`` are exact in float32 (8 x 15 <= 24 significant bits), so each
kernel row's value before its output rounding is the exact sum plus ``e`` with
``|e| <= g sum_i |x_hi,i| |W~_ji| <= g |x_hi|_1 A_j`` (the same for ``x_lo``). Then, with
``c^_hi``, ``c^_lo`` the kernel's bf16 outputs:

    |c_j - r_j| <= u |c_j|                                  the float32 sum c^_hi + c^_lo
                 + u_o (|c^_hi,j| + |c^_lo,j|)               the bf16 output roundings (RN)
                 + g (|x_hi|_1 + |x_lo|_1) A_j               float32 accumulation
                 + |x_res|_1 A_j                              sum_i x_res,i W~_ji
                 + |x|_1 E_j                                  sum_i x_i (W~_ji - W_ji)
                 + 2 K 2^-126 (1 + A_j + max|x|)              flushed subnormals (bf16 dot products run DAZ / FTZ)

and the code uses twice that (``B_j``): the factor 2 also covers the float64 rounding of
computing ``B`` itself, and a looser bound only adds candidates, never drops the answer.
``tests/sample/test_greedy_head.py`` checks ``|c - r| <= B`` on every element of thousands of rows.

For ``"int8_vnni"`` (the kernel's arithmetic: ``csrc/int8_gemm.cpp``'s header): with
``f = fl32(32767 / max|x|)``, each ``X_i = round(fl32(x_i f))`` is ``x_i f + e_i`` with ``|e_i| <= 0.5 +
32768 u <= 0.502``, and ``S_j = sum_i X_i q_ji`` is exact; so ``s_j S_j / f`` differs from
``sum_i x_i W~_ji`` by at most ``0.502 / f sum_i |W~_ji| <= 0.503 max|x| K A_j / 32767``. The kernel
then rounds ``S_j`` to float32 through two int32 sums (at most ``3 u 65790 sum_i |q_ji|``, i.e.
``<= 6.1 u max|x| K A_j`` in the scores' units) and multiplies by ``fl32(s_j fl32(max|x| / 32767))``
(four relative roundings against ``1 / f``: ``<= 4.01 u (|x|_1 A_j + 0.51 max|x| K A_j / 32767)``).
With the weight term as above, and no subnormals on this integer path (a row with ``0 < max|x| <
2^-100``, where ``f`` could overflow, goes to the full head):

    |c_j - r_j| <= |x|_1 E_j + A_j (max|x| K (0.503 / 32767 + 7 u) + 4.01 u |x|_1)

``"int8_avx2"`` has the same bound: its ``X_i``, ``S_j`` (exact in integers) and final float32 steps
are the VNNI kernel's; only the rounding of ``S_j`` to float32 differs: two int32 lane sums ``A``,
``B`` (K <= 1024: no int32 overflow, ``|A| + |B| <= 32767 sum_i |q_ji|``) rounded and added, three
roundings, at most ``2.01 u 32767 sum_i |q_ji|``, inside the ``3 u 65790 sum_i |q_ji|`` above.

and ``B_j`` is twice that. It has no term in ``|c_j|``, so the window below is ``D = 2 a`` with
``a = 2 (|x|_1 E_max + A_max (max|x| K (0.503 / 32767 + 7 u) + 4.01 u |x|_1))``.

Finding the candidates without computing ``B`` for every token: since
``|c^_hi| + |c^_lo| <= (1 + u)|c| + 2 |c^_lo|`` and ``|c^_lo| <= 2 |x_lo|_1 A_max``,
``B_j <= a + b |c_j|`` with the row constant ``a = 2 ((g (|x_hi|_1 + |x_lo|_1) + |x_res|_1) A_max
+ |x|_1 E_max + 4 u_o |x_lo|_1 A_max + 2 K 2^-126 (1 + A_max + max|x|))`` and
``b = 2 (u_o + 2 u)``. Then every ``j`` in ``C`` has ``c_j >= c_max - D`` with
``D = (2 a + 2 b |c_max|) / (1 - b)`` (``t -> t + b|t|`` is increasing, and
``max_k (c_k - B_k) >= c_max - a - b |c_max|``), and the maximiser of ``c_k - B_k`` lies there too.
So one pass takes the maxima of blocks of ``_BLOCK`` cheap scores, only the blocks whose maximum
reaches ``c_max - D`` are read again, and ``B_j`` is computed on their tokens that reach it; a
row with more than ``MAX_HIT_BLOCKS`` such blocks (``E_max`` is ~2x the typical ``E_j`` on real
rows, so ``D`` is wider than the candidates) gets ``B`` for the whole row in float64.

Exact re-score
--------------
Each candidate is re-scored in float64: products of two float32 (or bf16) values are exact in
float64 (<= 48 significant bits), the sum of K of them has error <= ``gamma_K(2^-53) sum|x_i W_ji|``
(~7e-14 relative for K = 640), twice that is used. Candidates whose float64 scores lie within
their bounds of the best are compared exactly: the sign of ``r_a - r_b`` is the sign of
``math.fsum`` over the 2K exact products (fsum is correctly rounded, and a non-zero exact sum of
such products is at least 2^-298 in magnitude, so it never rounds to zero).

bfloat16 models (``logits_kernel``)
-----------------------------------
A bfloat16 model's greedy token is the argmax of its full head's bf16 logits ``L_j``, lowest id on
their ties (frequent: 8 significant bits), and the exact argmax above would break those ties
differently. Where the full head is the AVX2 bf16 GEMM (``layers/bf16_gemm.py``; ``bf16_gemm_avx2.cpp``:
``L_j = bf16(s_j)``, ``s_j`` one float32 FMA chain over ``k`` from +0, each product of two bf16 values
exact, no bias), the head returns that token instead. With the fixed-point bound ``b_j`` above
(``|c_j - r_j| <= b_j``), Higham's bound for the chain (``|s_j - r_j| <= g |x|_1 (A_j + E_j) + K 2^-149``
for float32's subnormal steps, ``A_j + E_j >= max_i |W_ji|``) and the bf16 rounding (``|L_j - s_j| <=
u_o |s_j| + 2^-134``):

    |L_j - c_j| <= (1 + u_o) (b_j + g |x|_1 (A_j + E_j)) + u_o |c_j| + (K + 1) 2^-126

and the code uses ``T_j = P_j + 2 u_o |c_j|`` with ``P_j`` twice the rest (the factor 2, as above,
covers the float64 evaluation). Every token whose ``L_j`` is the row's largest satisfies
``c_j + T_j >= L_j >= L_k >= c_k - T_k`` for all ``k``, so the candidates ``{j : c_j + T_j >= max_k
(c_k - T_k)}`` hold all of them, and each candidate's ``L_j`` is no larger. ``int8_gemm.cpp``'s
``bf16_logit_candidates`` finds them (``low0 = c_top - T_top <= max_k (c_k - T_k)`` first: a float32
test over every token with ``E_j``, ``A_j`` and the row constants rounded up and a slack under
``low0`` larger than its float32 roundings near the threshold, then the float64 tests). Their
``L_j`` come from the same GEMM on just their weight rows (each output is one chain whatever the
others: the full head's bits), and the largest wins, lowest id first. A row with more than
``max_candidates`` candidates, or non-finite, falls back as above.

Which kind, and when: ``choose_greedy_head``, from the single-thread CPU times of the full head
vs the cheap pass + bound + re-score on Gemma 3 270M's 262,144 x 640 head and real hidden rows
(docs/performance.md; ``benchmarks/greedy_head.py``).
"""

from __future__ import annotations

import logging
import math

import torch

logger = logging.getLogger(__name__)

EXACT_GREEDY_HEAD_MODES = ("auto", "off")
# Rows with more candidates than this go back to the full head (see the module docstring).
MAX_CANDIDATES = 64
# Tokens per block of the candidate search (block maxima first; only blocks that reach the window
# are read again), and the most blocks per row read that way (more: the bound for the whole row).
_BLOCK = 256
MAX_HIT_BLOCKS = 64
# The same two limits for "int8_vnni" (module docstring): its bound leaves far fewer candidates on
# the default model's hidden rows (docs/performance.md).
MAX_CANDIDATES_VNNI = 4096
MAX_HIT_BLOCKS_VNNI = 2048
# The kinds whose cheap pass is the int8 kernel's 16-bit fixed-point arithmetic (one bound for both):
# "int8_vnni" (AVX-512 VNNI, fused in C++) and "int8_avx2" (AVX2, the torch two-pass search).
FIXED_POINT_KINDS = ("int8_vnni", "int8_avx2")
# "int8_avx2" sums each int32 lane over at most 1,024 columns (``csrc/int8_gemm.cpp``); its float32
# steps stay inside the bound's allowance only for that one chunk.
INT8_AVX2_MAX_HIDDEN = 1024
_U_BF16 = 2.0 ** -8   # bf16: 8 significant bits, round to nearest
_U_F32 = 2.0 ** -24
_U_F64 = 2.0 ** -53


def gamma(k: int, u: float) -> float:
    """Higham's ``gamma_k = k u / (1 - k u)``: the relative error bound of a sum of ``k`` terms in
    any order with unit roundoff ``u`` (relative to the sum of the terms' magnitudes).

    Raises:
        ValueError: if ``k u >= 1``.
    """
    if k * u >= 1.0:
        raise ValueError(f"gamma_k undefined for k={k}, u={u}")
    return k * u / (1.0 - k * u)


def _float32_up(t: torch.Tensor) -> torch.Tensor:
    """float64 -> the smallest float32 value >= each element (finite inputs)."""
    f = t.float()
    low = f.double() < t
    return torch.where(low, torch.nextafter(f, torch.full_like(f, math.inf)), f).contiguous()


def round_up_to_bf16(t: torch.Tensor) -> torch.Tensor:
    """float32 -> the smallest bfloat16 value >= each element (as float32); finite inputs >= 0."""
    b = t.to(torch.bfloat16).float()
    low = b < t
    if bool(low.any()):  # one bf16 ulp up: add one to the bf16 bit pattern of positive values
        bits = t[low].to(torch.bfloat16).view(torch.int16) + 1
        b[low] = bits.view(torch.bfloat16).float()
    return b


class ExactGreedyHead:
    """The exact argmax of ``x @ W^T`` per row through a cheap pass and an exact re-score.

    Args:
        weight: [V, K] the model's head weight as stored (float32 or bfloat16, CPU); referenced,
            not copied (the re-score reads its rows).
        kind: "bf16" (oneDNN packed bf16 copy, +V K 2 bytes) or "int8" (int8 copy + bf16 scales,
            +V (K + 2) bytes).
        batch_hint: rows the oneDNN layout is tuned for (``max_num_seqs``).
        max_rows: the most rows per step it is used for (``GREEDY_HEAD_MAX_ROWS``; read by the
            model runner).
        logits_kernel: for a bfloat16 model, the bf16 GEMM extension that runs its full head
            (``layers/bf16_gemm.py``'s ``bf16_module``: ``pack_bf16_weight`` / ``bf16_linear``). The
            head then returns the argmax of *that head's* bf16 logits, lowest id on their ties,
            instead of the exact argmax (module docstring, "bfloat16 models"). Needs a fixed-point
            kind and a bfloat16 weight.
    Raises:
        ValueError: for another kind or weight dtype, or ``logits_kernel`` with a float32 weight or
            a kind that is not fixed-point.
    """

    def __init__(self, weight: torch.Tensor, kind: str, batch_hint: int = 1, max_rows: int = 64,
                 logits_kernel=None) -> None:
        if weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"weight must be [V, K] float32 or bfloat16, got {list(weight.shape)} {weight.dtype}")
        if logits_kernel is not None and (weight.dtype != torch.bfloat16 or kind not in FIXED_POINT_KINDS):
            raise ValueError(f"logits_kernel needs a bfloat16 weight and a kind in {FIXED_POINT_KINDS}, "
                             f"got {weight.dtype} and {kind!r}")
        self.weight = weight.detach()
        self.kind = kind
        self.logits_kernel = logits_kernel
        self.max_rows = int(max_rows)
        self.vocab_size, self.hidden_size = int(weight.shape[0]), int(weight.shape[1])
        if kind == "bf16":
            from pagedllm.layers.linear import PackedLinear

            w = self.weight.float()
            wq = self.weight.to(torch.bfloat16)
            self._layer = PackedLinear(wq, None, max(1, int(batch_hint)))
            self.extra_bytes = wq.numel() * 2
            self.weight_error, self.approx_max = self._error_constants(w, wq.float())
        elif kind == "int8":
            w = self.weight.float()
            scale = round_up_to_bf16(w.abs().amax(dim=1) / 127.0)
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            self.qweight = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
            self.scales = scale.to(torch.bfloat16)                       # exact: bf16 values
            self.extra_bytes = self.qweight.numel() + 2 * self.scales.numel()
            # q s is exact in float32 (8 x 8 significant bits)
            self.weight_error, self.approx_max = self._error_constants(w, self.qweight.float() * scale[:, None])
        elif kind in FIXED_POINT_KINDS:
            from pagedllm.layers.int8_gemm import load_int8_gemm

            if self.hidden_size % 16:
                raise ValueError(f"kind {kind!r} needs a hidden size that is a multiple of 16, got {self.hidden_size}")
            if kind == "int8_avx2" and self.hidden_size > INT8_AVX2_MAX_HIDDEN:
                raise ValueError(f"kind 'int8_avx2' needs a hidden size of at most {INT8_AVX2_MAX_HIDDEN} (its bound "
                                 f"assumes one int32 chunk per lane), got {self.hidden_size}")
            self._ext = load_int8_gemm()
            isa = "avx512_vnni" if kind == "int8_vnni" else "avx2"
            if self._ext is None or isa not in self._ext.compiled_isas():
                raise ValueError(f"kind {kind!r} needs the int8 kernel's {isa} code, which is not built here")
            # The int8 kind's codes, scales and constants, in one C++ pass per row (no float copies).
            qweight, self.scales, self.weight_error, self.approx_max = self._ext.quantize_int8_rows(self.weight)
            self.packed, self.row_sums = self._ext.pack_int8_weight(qweight)
            del qweight
            self.qweight = None
            self.extra_bytes = self.packed.numel() + 4 * self.row_sums.numel() + 4 * self.scales.numel()
        else:
            raise ValueError(f"kind must be 'bf16', 'int8', 'int8_vnni' or 'int8_avx2', got {kind!r}")
        # The fixed-point kinds' window is wider (its weight term) and its candidates are re-scored without a
        # second pass: it takes more of both before a row goes to the full head.
        self.max_candidates = MAX_CANDIDATES_VNNI if kind in FIXED_POINT_KINDS else MAX_CANDIDATES
        self.max_hit_blocks = MAX_HIT_BLOCKS_VNNI if kind in FIXED_POINT_KINDS else MAX_HIT_BLOCKS
        self.g32 = gamma(self.hidden_size, _U_F32)
        self.g64 = gamma(self.hidden_size, _U_F64)
        self.weight_error_max = float(self.weight_error.max())
        self.approx_max_max = float(self.approx_max.max())
        # Per block of _BLOCK tokens: the largest E_j and A_j (the fixed-point kinds' per-block window).
        nb = -(-self.vocab_size // _BLOCK)
        pad = nb * _BLOCK - self.vocab_size
        self.block_weight_error = torch.nn.functional.pad(self.weight_error, (0, pad)).view(nb, _BLOCK).amax(dim=1)
        self.block_approx_max = torch.nn.functional.pad(self.approx_max, (0, pad)).view(nb, _BLOCK).amax(dim=1)
        if kind == "int8_vnni":
            # The fused C++ pass (``_argmax_fused``): 2 E_j and 2 A_j as float32 rounded up, and the
            # head weight contiguous for its re-score (a view when it already is: no copy).
            self._err2 = _float32_up(2.0 * self.weight_error)
            self._amax2 = _float32_up(2.0 * self.approx_max)
            self._weight_c = self.weight.contiguous()
        if logits_kernel is not None:   # the candidate search's float32 first test (E_j, A_j rounded up)
            self._err_up, self._amax_up = _float32_up(self.weight_error), _float32_up(self.approx_max)
        self.num_rows = 0            # rows asked (counters for tests and logs)
        self.num_fallback_rows = 0

    @staticmethod
    def _error_constants(w: torch.Tensor, approx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token (float64 [V]): ``E_j = max_i |W~_ji - W_ji|`` and ``A_j = max_i |W~_ji|``."""
        err = torch.empty(w.shape[0], dtype=torch.float64)
        for lo in range(0, w.shape[0], 16384):   # chunks: float64 copies stay small
            hi = min(lo + 16384, w.shape[0])
            err[lo:hi] = (approx[lo:hi].double() - w[lo:hi].double()).abs().amax(dim=1)
        return err, approx.abs().amax(dim=1).double()

    # -- the cheap pass and its bound --

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, bool, dict[str, torch.Tensor]]:
        """The kernel's bf16 input and the per-row norms of the bound.

        A float32 row is split into ``x_hi = bf16(x)`` and ``x_lo = bf16(x - x_hi)`` (two kernel
        rows: at a decode step's few rows the head's cost hardly depends on M), leaving
        ``x_res = x - x_hi - x_lo`` (|x_res| <= 2^-16 |x|) in the bound; a bf16 row is its own
        ``x_hi``.

        Returns:
            (kernel input [M or 2M, K] bf16, split, per-row float64 [M]: ``n1`` = |x|_1,
            ``nhl`` = |x_hi|_1 + |x_lo|_1, ``nlo`` = |x_lo|_1, ``nres`` = |x_res|_1, ``xinf`` = max|x|).
        """
        xd = x.double()
        hi = x.to(torch.bfloat16)
        split = x.dtype != torch.bfloat16
        if split:
            lo = (x.float() - hi.float()).to(torch.bfloat16)      # x - x_hi is exact in float32
            res = xd - hi.double() - lo.double()                   # exact in float64
            kin = torch.cat([hi, lo]).contiguous()
            nlo = lo.double().abs().sum(dim=1)
        else:
            res = torch.zeros_like(xd)
            kin = hi.contiguous()
            nlo = torch.zeros(x.shape[0], dtype=torch.float64)
        norms = {"n1": xd.abs().sum(dim=1), "nhl": hi.double().abs().sum(dim=1) + nlo, "nlo": nlo,
                 "nres": res.abs().sum(dim=1), "xinf": xd.abs().amax(dim=1)}
        return kin, split, norms

    def cheap_pass(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        """[M, K] -> (``c_hi`` [M, V] bf16, ``c_lo`` [M, V] bf16 or None, the row norms of ``_split``);
        ``int8_vnni`` / ``int8_avx2``: (``c`` [M, V] float32, None, ``n1`` = |x|_1 and ``xinf`` = max|x| [M]
        float64)."""
        if self.kind in FIXED_POINT_KINDS:   # the row goes in as it is (16-bit fixed point inside the kernel)
            xd = x.double()
            norms = {"n1": xd.abs().sum(dim=1), "xinf": xd.abs().amax(dim=1)}
            c = self._ext.int8_weight_only_mm(x.float().contiguous(), self.packed, self.row_sums, self.scales,
                                              None, self.vocab_size)
            return c, None, norms
        kin, split, norms = self._split(x)
        if self.kind == "bf16":
            out = self._layer(kin)
        else:
            out = torch.ops.aten._weight_int8pack_mm(kin, self.qweight, self.scales)
        m = x.shape[0]
        return (out[:m], out[m:], norms) if split else (out, None, norms)

    @staticmethod
    def combine(c_hi: torch.Tensor, c_lo: torch.Tensor | None) -> torch.Tensor:
        """The cheap scores ``c = fl32(c_hi + c_lo)`` [M, V] float32."""
        c = c_hi.float()
        return c if c_lo is None else c.add_(c_lo)

    def _bound(self, norms: dict[str, torch.Tensor], rows: torch.Tensor | None, toks: torch.Tensor,
               c: torch.Tensor, c_hi: torch.Tensor, c_lo: torch.Tensor | None) -> torch.Tensor:
        """``B`` (float64, twice the derived bound) for the tokens ``toks`` of rows ``rows`` (None:
        ``toks`` is [V] and every row gets all of them); ``c``, ``c_hi``, ``c_lo`` shaped like the result."""
        def per_row(name):
            t = norms[name]
            return t[:, None] if rows is None else t[rows]
        a_j, e_j = self.approx_max[toks], self.weight_error[toks]
        if self.kind in FIXED_POINT_KINDS:
            return 2.0 * (per_row("n1") * e_j + a_j * self._vnni_row_term(per_row("n1"), per_row("xinf")))
        eta = 2.0 * self.hidden_size * 2.0 ** -126 * (1.0 + self.approx_max_max + per_row("xinf"))
        coef_a = self.g32 * per_row("nhl") + per_row("nres")
        outs = c_hi.double().abs() if c_lo is None else c_hi.double().abs() + c_lo.double().abs()
        return 2.0 * (coef_a * a_j + per_row("n1") * e_j + _U_BF16 * outs + _U_F32 * c.double().abs() + eta)

    def _vnni_row_term(self, n1: torch.Tensor, xinf: torch.Tensor) -> torch.Tensor:
        """``int8_vnni`` / ``int8_avx2``: the bound's factor of ``A_j`` (module docstring): the row's fixed-point
        rounding, ``0.503 xinf K / 32767``, and the kernel's float32 steps, ``7 u xinf K + 4.01 u |x|_1``
        (plus ``2^-100`` for what the derivation's first-order terms leave out)."""
        k = self.hidden_size
        return xinf * k * (0.503 / 32767.0 + 7.0 * _U_F32) + 4.01 * _U_F32 * n1 + 2.0 ** -100

    def error_bound(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cheap scores ``c`` [M, V] float32, ``B`` [M, V] float64) with ``|c - r| <= B``
        elementwise. Dense: for tests; ``argmax`` computes ``B`` on its candidates only."""
        c_hi, c_lo, norms = self.cheap_pass(x)
        c = self.combine(c_hi, c_lo)
        return c, self._bound(norms, None, torch.arange(self.vocab_size), c, c_hi, c_lo)

    # -- the two-pass argmax --

    @torch.inference_mode()
    def argmax(self, x: torch.Tensor, forbidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact argmax of ``x @ W^T`` per row (module docstring), over the tokens
        ``forbidden`` leaves (a grammar's mask): the proof holds with every max and candidate
        taken over the allowed tokens only, which is what setting their cheap scores to -inf
        before the window does (``_argmax_two_pass``).

        Args:
            x: [M, K] hidden rows (float32 or bfloat16).
            forbidden: None, or [M, V] bool, True for tokens the row may not take.
        Returns:
            (token ids [M] int64, fallback [M] bool): rows marked fallback hold -1 and need the
            full head (non-finite row, no allowed token, or more than ``MAX_CANDIDATES``
            candidates).
        """
        self.num_rows += x.shape[0]
        if self.logits_kernel is not None:
            tokens, fallback = self._argmax_bf16_logits(x, forbidden)
        elif forbidden is not None:
            tokens, fallback = self._argmax_two_pass(x, forbidden)
        elif self.kind == "int8_vnni":
            tokens, fallback = self._argmax_fused(x)
        else:
            tokens, fallback = self._argmax_two_pass(x)
        self.num_fallback_rows += int(fallback.sum())
        return tokens, fallback

    def _argmax_fused(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``int8_vnni``: the cheap pass, the bound, the candidates and their float64 re-score in
        one C++ call (``int8_gemm.cpp``'s ``int8_greedy_argmax``): no [M, V] scores are written.

        It evaluates ``B_j = n1 (2 E_j) + t (2 A_j)`` (``t`` = ``_vnni_row_term``) and ``c_j +- B_j``
        in float32, with ``2 E_j``, ``2 A_j``, ``n1`` and ``t`` rounded up to float32. That is safe:
        ``B_j`` is twice the derived bound ``b_j``, and ``b_j >= 4.01 u |x|_1 A_j >= 4 u |c_j|``
        (``|c_j| <= |x|_1 A_j`` up to ``b_j``), so the three float32 roundings of ``B_j`` and the
        one of ``c_j +- B_j`` (each at most ``u`` relative, ``u`` = 2^-24) move ``c_j +- B_j`` by
        less than ``b_j``: the computed ``c_j + B_j`` stays >= ``c_j + b_j`` >= ``r_j`` and the
        computed ``c_k - B_k`` <= ``r_k``, so every exact maximum is still a candidate. Rows the
        kernel cannot decide alone (a rival within both float64 error bounds) are decided by
        ``_argmax_two_pass`` (exact ``math.fsum`` comparison); rows past ``max_candidates`` and
        non-finite rows fall back."""
        xin = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
        xin = xin.contiguous()
        xd = xin.double()
        n1, xinf = xd.abs().sum(dim=1), xd.abs().amax(dim=1)
        term = self._vnni_row_term(n1, xinf)
        fallback = ~(torch.isfinite(n1) & torch.isfinite(term)) | _fixed_point_too_small(xinf)
        safe = ~fallback
        tokens, status, _ = self._ext.int8_greedy_argmax(
            xin, self.packed, self.row_sums, self.scales, self.vocab_size, self._weight_c, self._err2, self._amax2,
            _float32_up(torch.where(safe, n1, 0.0)), _float32_up(torch.where(safe, term, 0.0)),
            self.max_candidates, self.g64)
        fallback |= status == 1
        tokens[fallback] = -1
        close = ((status == 2) & ~fallback).nonzero().squeeze(1)
        if close.numel():
            t2, f2 = self._argmax_two_pass(xin[close])
            tokens[close] = t2
            fallback[close] = f2
        return tokens, fallback

    def _argmax_two_pass(self, x: torch.Tensor, forbidden: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """``argmax`` in torch ops: the cheap pass's [M, V] scores, block maxima, the bound on the
        tokens of the blocks that reach the window, the exact re-score (module docstring).
        ``forbidden`` ([M, V] bool): those tokens' cheap scores are -inf, so they are never the
        top, never in the window and never candidates."""
        m, v = x.shape[0], self.vocab_size
        c_hi, c_lo, norms = self.cheap_pass(x)
        c = self.combine(c_hi, c_lo)                                           # [M, V] float32
        if forbidden is not None:
            c = c.masked_fill(forbidden, -math.inf)
        # Block maxima of c: a candidate's block reaches the window, so only those blocks are read again.
        nfull = v // _BLOCK
        bmax = c[:, : nfull * _BLOCK].view(m, nfull, _BLOCK).amax(dim=-1)    # [M, nb]
        if nfull * _BLOCK < v:
            bmax = torch.cat([bmax, c[:, nfull * _BLOCK:].amax(dim=-1, keepdim=True)], dim=1)
        cmax = bmax.amax(dim=1).double()
        if self.kind in FIXED_POINT_KINDS:
            # Every candidate j has c_j + B_j >= max_k (c_k - B_k) >= c_top - B_top (top = the largest
            # c), and B_j <= 2 (|x|_1 E_max(b) + A_max(b) t) on its block b: a block whose maximum
            # plus that cannot reach c_top - B_top holds no candidate.
            top = c.argmax(dim=1)
            term = self._vnni_row_term(norms["n1"], norms["xinf"])                         # [M]
            b_top = 2.0 * (norms["n1"] * self.weight_error[top] + self.approx_max[top] * term)
            reach = 2.0 * (norms["n1"][:, None] * self.block_weight_error[None, :]
                           + term[:, None] * self.block_approx_max[None, :])               # [M, nb]
        # Uniform window D (module docstring): every candidate has c >= cmax - D.
        if self.kind in FIXED_POINT_KINDS:   # B_j <= alpha: no term in |c_j|
            alpha = 2.0 * (norms["n1"] * self.weight_error_max
                           + self.approx_max_max * self._vnni_row_term(norms["n1"], norms["xinf"]))
            beta = 0.0
        else:
            alpha = 2.0 * ((self.g32 * norms["nhl"] + norms["nres"]) * self.approx_max_max
                           + norms["n1"] * self.weight_error_max + 4.0 * _U_BF16 * norms["nlo"] * self.approx_max_max
                           + 2.0 * self.hidden_size * 2.0 ** -126 * (1.0 + self.approx_max_max + norms["xinf"]))
            beta = 2.0 * (_U_BF16 + 2.0 * _U_F32)
        thr = cmax - (2.0 * alpha + 2.0 * beta * cmax.abs()) / (1.0 - beta)   # [M] float64
        fallback = ~(torch.isfinite(cmax) & torch.isfinite(norms["n1"]))
        if self.kind in FIXED_POINT_KINDS:   # 32767 / max|x| would overflow float32: not this path
            fallback |= _fixed_point_too_small(norms["xinf"])
        if self.kind in FIXED_POINT_KINDS:
            hit = (bmax.double() + reach >= (cmax - b_top)[:, None]) & ~fallback[:, None]
        else:
            hit = (bmax.double() >= thr[:, None]) & ~fallback[:, None]       # [M, nb]
        wide = hit.sum(dim=1) > self.max_hit_blocks
        hit &= ~wide[:, None]
        hit_row, hit_blk = hit.nonzero(as_tuple=True)                          # [P]
        cols = hit_blk[:, None] * _BLOCK + torch.arange(_BLOCK)[None, :]      # [P, BLOCK]
        vals = c[hit_row[:, None], cols.clamp(max=v - 1)].double()
        vals.masked_fill_(cols >= v, -math.inf)
        if self.kind in FIXED_POINT_KINDS:
            keep_tok = vals + reach[hit_row, hit_blk][:, None] >= (cmax - b_top)[hit_row][:, None]
        else:
            keep_tok = vals >= thr[hit_row][:, None]
        pr, pc = keep_tok.nonzero(as_tuple=True)
        cand_row, cand_tok, cand_c = hit_row[pr], cols[pr, pc], vals[pr, pc]  # [Q]
        # The exact per-token bound on those tokens, then c + B >= max (c - B).
        bound = self._bound(norms, cand_row, cand_tok, cand_c, c_hi[cand_row, cand_tok],
                            None if c_lo is None else c_lo[cand_row, cand_tok])
        low = torch.full((m,), -math.inf, dtype=torch.float64)
        low.scatter_reduce_(0, cand_row, cand_c - bound, reduce="amax")
        sel = cand_c + bound >= low[cand_row]
        cand_row, cand_tok = cand_row[sel], cand_tok[sel]
        if bool(wide.any()):
            # The window spans more than MAX_HIT_BLOCKS blocks: the per-token bound on the whole row.
            w_rows = wide.nonzero().squeeze(1)
            sub = {name: t[w_rows] for name, t in norms.items()}
            cw = c[w_rows]
            bw = self._bound(sub, None, torch.arange(v), cw, c_hi[w_rows], None if c_lo is None else c_lo[w_rows])
            cwd = cw.double()
            selw = cwd + bw >= (cwd - bw).amax(dim=1, keepdim=True)           # [F, V]
            wr, wt = selw.nonzero(as_tuple=True)
            cand_row, cand_tok = torch.cat([cand_row, w_rows[wr]]), torch.cat([cand_tok, wt])
        fallback |= torch.bincount(cand_row, minlength=m) > self.max_candidates
        keep = ~fallback[cand_row]
        cand_row, cand_tok = cand_row[keep], cand_tok[keep]
        tokens = torch.full((m,), -1, dtype=torch.int64)
        if cand_row.numel():
            self._rescore(x, cand_row, cand_tok, tokens)
        return tokens, fallback

    def _argmax_bf16_logits(self, x: torch.Tensor, forbidden: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """``argmax`` with ``logits_kernel``: the argmax of the full head's bf16 logits ``L_j``
        (``logits_kernel.bf16_linear``), lowest id on ties (module docstring, "bfloat16 models").
        The fixed-point cheap pass, the window ``T_j = P_j + 2 u_o |c_j|`` around each cheap score,
        then the candidates' ``L_j`` from the head's own kernel on just their weight rows."""
        m = x.shape[0]
        c, _, norms = self.cheap_pass(x)                                       # [M, V] float32
        if forbidden is not None:
            c = c.masked_fill(forbidden, -math.inf)
        n1, term = norms["n1"], self._vnni_row_term(norms["n1"], norms["xinf"])   # [M] float64
        # The window (module docstring, "bfloat16 models"), in C++: every token whose bf16 logit can be the
        # row's largest, i.e. c_j + T_j >= max_k (c_k - T_k) with T_j = P_j + 2 u_o |c_j|.
        cand_row, cand_tok, cmax = self._ext.bf16_logit_candidates(
            c.contiguous(), n1.contiguous(), term.contiguous(), self.weight_error, self.approx_max,
            self._err_up, self._amax_up, self.weight_error_max, self.approx_max_max, self.g32, _U_BF16, (self.hidden_size + 1) * 2.0 ** -126)
        counts = torch.bincount(cand_row, minlength=m)
        fallback = ~(torch.isfinite(cmax) & torch.isfinite(n1)) | _fixed_point_too_small(norms["xinf"]) \
            | (counts > self.max_candidates)
        keep = ~fallback[cand_row]
        cand_row, cand_tok = cand_row[keep], cand_tok[keep]
        tokens = torch.full((m,), -1, dtype=torch.int64)
        if cand_row.numel():
            # L_j of the candidates through the full head's kernel (one float32 chain per output in k
            # order, whatever the other outputs: the full head's bits); ascending ids, so argmax's first
            # maximum is the lowest id of a tie.
            # One row: its candidates are already unique and ascending.
            toks, inv = (cand_tok, None) if m == 1 else torch.unique(cand_tok, sorted=True, return_inverse=True)
            packed = self.logits_kernel.pack_bf16_weight(self.weight.index_select(0, toks).contiguous())
            logits = self.logits_kernel.bf16_linear(x.to(torch.bfloat16).contiguous(), packed, None,
                                                    int(toks.numel())).float()             # [M, Q']
            if inv is None:
                tokens = toks[logits.argmax(dim=1)]
            else:
                scores = torch.full_like(logits, -math.inf)
                scores[cand_row, inv] = logits[cand_row, inv]
                tokens = torch.where((counts > 0) & ~fallback, toks[scores.argmax(dim=1)], tokens)
        return tokens, fallback

    def _rescore(self, x: torch.Tensor, cand_row: torch.Tensor, cand_tok: torch.Tensor,
                 tokens: torch.Tensor) -> None:
        """Write into ``tokens`` the exact best candidate of each row (lowest index on ties)."""
        xd = x.double()
        wd = self.weight.index_select(0, cand_tok).double()                   # [Q, K]
        xr = xd.index_select(0, cand_row)                                      # [Q, K]
        score = (wd * xr).sum(dim=1)                                           # [Q]
        err = 2.0 * self.g64 * (wd.abs() * xr.abs()).sum(dim=1)               # [Q]
        rows, toks = cand_row.tolist(), cand_tok.tolist()
        score_l, err_l = score.tolist(), err.tolist()
        per_row: dict[int, list[int]] = {}
        for q, r in enumerate(rows):
            per_row.setdefault(r, []).append(q)
        for r, qs in per_row.items():
            best = max(qs, key=lambda q: (score_l[q], -toks[q]))
            close = [q for q in qs if score_l[q] + err_l[q] >= score_l[best] - err_l[best]]
            if len(close) > 1:  # within float64 error of each other: decide exactly
                best = self._exact_best(xd[r], [toks[q] for q in close], close)
            tokens[r] = toks[best]

    def _exact_best(self, xrow: torch.Tensor, toks: list[int], qs: list[int]) -> int:
        """Among candidate tokens ``toks`` (their entries ``qs``), the one with the largest exact
        score, lowest token id on ties; exact signs through ``math.fsum`` of exact products."""
        rows = self.weight.index_select(0, torch.tensor(toks)).double()       # [n, K]
        prods = (rows * xrow[None, :]).tolist()                                # exact in float64
        order = sorted(range(len(toks)), key=lambda i: toks[i])
        best = order[0]
        for i in order[1:]:
            if math.fsum(prods[i] + [-p for p in prods[best]]) > 0.0:
                best = i
        return qs[best]


def _fixed_point_too_small(xinf: torch.Tensor) -> torch.Tensor:
    """[M] bool: rows whose ``0 < max|x| < 2^-100``, where the fixed-point kinds' scale ``32767 / max|x|``
    could overflow float32 (they go to the full head)."""
    return (xinf > 0) & (xinf < 2.0 ** -100)


def choose_greedy_head(mode: str, model_dtype: torch.dtype, device: torch.device, tp_size: int,
                       quantization: str | None, is_last_stage: bool = True, cpu_isa: str = "auto",
                       flags: frozenset[str] | None = None, hidden_size: int | None = None,
                       linear_kind: str | None = None, logits_edit: str | None = None
                       ) -> tuple[str | None, str]:
    """Whether the exact greedy head runs, and with which cheap kind (it then runs for steps with up
    to ``GREEDY_HEAD_MAX_ROWS[kind]`` plain greedy rows).

    ``auto`` on the CPU, one tensor rank, no quantization, last pipeline stage:

    - float32 model on a CPU with AVX-512 VNNI (``layers.int8_gemm.int8_kernel_for(cpu_isa)``):
      ``"int8_vnni"``, fused in C++ (``_argmax_fused``), for steps with up to ``INT8_VNNI_MAX_ROWS``
      plain greedy rows. Measured on the default model's head and real hidden rows (full head +
      argmax vs the fused pass): 1.9-3.3x less head time at M = 1-64 on one thread, 1.8-3.4x on two
      (docs/performance.md).
    - float32 model, native bf16 (``onednn_linear_available(bfloat16)``), no VNNI: ``"bf16"`` for steps
      with up to ``BF16_MAX_ROWS`` plain greedy rows. Measured on Gemma 3 270M's head and real
      hidden rows (AVX-512 bf16, one thread): 1.55x less head time at M = 1, 1.31x at 8, 1.09x
      at 16 (noise), 0.71x at 64 (the activation split doubles the kernel's rows).
    - float32 model, AVX2 + FMA without VNNI or native bf16, hidden size a multiple of 16 and at
      most ``INT8_AVX2_MAX_HIDDEN``: ``"int8_avx2"`` for steps with up to ``INT8_AVX2_MAX_ROWS``
      plain greedy rows (docs/benchmarks.md, "The exact greedy head on AVX2").
    - float32 model otherwise without native bf16: off. Only torch's int8 pass is left there; its
      bound (``s_j / 2 |x|_1`` per token) is ~4x bf16's, and on the same rows it won 1.29x at M = 1
      but lost from M = 4 on (rows with more than ``MAX_CANDIDATES`` candidates fall back).
    - bfloat16 model whose head runs on the AVX2 bf16 GEMM (``linear_kind`` ``"avx2_bf16"``), no edit
      of the logits after the head (``logits_edit`` None: no final soft cap, no logit scaling), the
      AVX2 int8 pass available and the hidden size as above: ``"int8_avx2"`` with that GEMM as
      ``logits_kernel`` (the argmax of the full head's own bf16 logits, their ties included: module
      docstring, "bfloat16 models"), for steps with up to ``INT8_AVX2_BF16_MAX_ROWS`` plain greedy
      rows (``greedy_head_max_rows``). The int8 pass reads half the bf16 head's bytes; measured on
      the default model (docs/benchmarks.md, "The greedy head for bf16 models on AVX2").
    - bfloat16 model otherwise: off. Its greedy token stays the argmax of its bf16 logits as the
      full head gives them (lowest id on their frequent exact ties: the exact head would take the
      exact best there, in a trial 4 of 8 prompts x 24 tokens parted that way); with oneDNN or the
      AVX-512 / AMX GEMMs the fused int8 pass tied the bf16 head at 12-48 rows (1.6x at one row) and
      their re-score through the head's own kernel is not measured.

    Numbers: docs/performance.md.

    Args:
        flags: the CPU's flags (default: this machine's).
        hidden_size: the head's K (``"int8_avx2"`` only where it is known and fits).
        linear_kind: the kernel plan's linear kind (``layers.linear.choose_linear``), which runs the
            head: a bfloat16 model takes the head only on ``"avx2_bf16"``.
        logits_edit: what the model does to the head's logits before sampling (e.g. "final logit
            soft cap"), or None: a bfloat16 model takes the head only with None (an edit rounds
            again and can make new ties).
    Returns:
        (kind, or None for off; the reason in words, for the kernel plan's table).
    Raises:
        ValueError: for a mode outside ``EXACT_GREEDY_HEAD_MODES``.
    """
    if mode not in EXACT_GREEDY_HEAD_MODES:
        raise ValueError(f"exact_greedy_head must be one of {EXACT_GREEDY_HEAD_MODES}, got {mode!r}")
    if mode == "off":
        return None, "exact_greedy_head='off' (--exact-greedy-head off)"
    if device.type != "cpu":
        return None, "not on the CPU"
    if tp_size > 1:
        return None, "the head is split across tensor ranks"
    if not is_last_stage:
        return None, "not the last pipeline stage"
    if quantization not in (None, "gguf"):  # "gguf": dequantized weights in the model dtype
        return None, f"quantization={quantization} (the head itself is quantized)"
    if model_dtype == torch.bfloat16:
        return _choose_for_bf16(cpu_isa, flags, hidden_size, linear_kind, logits_edit)
    if model_dtype != torch.float32:
        return None, f"dtype {model_dtype}"
    from pagedllm.layers.int8_gemm import VNNI_KERNEL, int8_kernel_for
    from pagedllm.layers.linear import onednn_linear_available

    if int8_kernel_for(cpu_isa, flags)[0] == VNNI_KERNEL:
        return "int8_vnni", "float32 model, AVX-512 VNNI: int8 cheap pass"
    if onednn_linear_available(torch.bfloat16):
        return "bf16", "float32 model, native bf16: bf16 cheap pass"
    why = _int8_avx2_refusal(cpu_isa, flags, hidden_size)
    if why is not None:
        return None, f"float32 model without native bf16 or VNNI, and {why}"
    return "int8_avx2", "float32 model, AVX2 without VNNI: int8 fixed-point cheap pass"


def _int8_avx2_refusal(cpu_isa: str, flags: frozenset[str] | None, hidden_size: int | None) -> str | None:
    """Why the AVX2 int8 pass cannot take this head, in words; None when it can."""
    from pagedllm.layers.int8_gemm import int8_avx2_unavailable

    if hidden_size is None or hidden_size % 16 or hidden_size > INT8_AVX2_MAX_HIDDEN:
        return f"hidden size {hidden_size}: the AVX2 int8 pass takes multiples of 16 up to {INT8_AVX2_MAX_HIDDEN}"
    why = int8_avx2_unavailable(cpu_isa, flags)
    return None if why is None else f"the AVX2 int8 pass cannot run: {why}"


def _choose_for_bf16(cpu_isa: str, flags: frozenset[str] | None, hidden_size: int | None,
                     linear_kind: str | None, logits_edit: str | None) -> tuple[str | None, str]:
    """``choose_greedy_head`` for a bfloat16 model (its docstring)."""
    from pagedllm.layers.bf16_gemm import AVX2_KERNEL

    off = "bfloat16 model: its greedy token stays the argmax of its bf16 logits from the full head"
    if linear_kind != AVX2_KERNEL:
        return None, f"{off} (the head runs on {linear_kind}; the bf16-logit head re-scores on the AVX2 bf16 GEMM only)"
    if logits_edit is not None:
        return None, f"{off} (the model edits its logits after the head: {logits_edit})"
    why = _int8_avx2_refusal(cpu_isa, flags, hidden_size)
    if why is not None:
        return None, f"{off} ({why})"
    return "int8_avx2", ("bfloat16 model, AVX2 bf16 GEMM: int8 fixed-point cheap pass, candidates re-scored "
                         "through the head's own GEMM (the argmax of its bf16 logits, ties included)")


# Plain greedy rows per step up to which the bf16 pass wins (docs/performance.md).
BF16_MAX_ROWS = 8
# The same for the int8 VNNI pass, fused in C++ (docs/performance.md): it wins at
# every row count measured (1-64), so the limit is only what its per-row scratch allows.
INT8_VNNI_MAX_ROWS = 1024
# Per kind ``choose_greedy_head`` picks: the most plain greedy rows per step it is used for.
# The same for the AVX2 int8 pass (docs/benchmarks.md, "The exact greedy head on AVX2").
INT8_AVX2_MAX_ROWS = 4
GREEDY_HEAD_MAX_ROWS = {"bf16": BF16_MAX_ROWS, "int8_vnni": INT8_VNNI_MAX_ROWS, "int8_avx2": INT8_AVX2_MAX_ROWS}
# The same for a bfloat16 model's head (against the AVX2 bf16 GEMM's head: docs/benchmarks.md, "The
# greedy head for bf16 models on AVX2").
INT8_AVX2_BF16_MAX_ROWS = 3


def greedy_head_max_rows(kind: str | None, model_dtype: torch.dtype) -> int:
    """The most plain greedy rows per step the head of ``kind`` (``choose_greedy_head``'s) is used
    for with a model of ``model_dtype``; 0 when off."""
    if kind is None:
        return 0
    if model_dtype == torch.bfloat16:
        return INT8_AVX2_BF16_MAX_ROWS
    return GREEDY_HEAD_MAX_ROWS[kind]
