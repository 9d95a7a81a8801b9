"""Apply the step's grammar bitmask to the logits, where the worker samples (torch only)."""

from __future__ import annotations

import numpy as np
import torch


def forbidden_tokens(bitmask: np.ndarray, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The tokens a grammar bitmask forbids.

    Args:
        bitmask: [k, >= ceil(vocab_size / 32)] int32 (bit ``t % 32`` of word ``t // 32`` set =
            token ``t`` allowed).
        vocab_size: tokens to unpack (the logits width).
    Returns:
        [k, vocab_size] bool on ``device``, True where the token is forbidden.
    """
    # Little-endian words: byte b of word w holds tokens 32w + 8b .. 32w + 8b + 7, low bit first.
    words = np.invert(np.ascontiguousarray(bitmask, dtype="<i4"))
    forbidden = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]  # [k, V] 0/1
    return torch.from_numpy(forbidden).view(torch.bool).to(device)


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> None:
    """Set the logits of tokens the grammar forbids to -inf, in place.

    The forbidden bits are unpacked to a bool mask (``np.unpackbits`` of the inverted words) and
    applied with ``masked_fill_`` where the rows lie: one call when ``rows`` is ``0..k-1`` (every
    row of an all-constrained batch), else one per row. No copy of the logits rows out and back,
    and torch's threads instead of xgrammar's single-threaded CPU kernel, 2-4x slower at 16-64
    rows of a 262k vocabulary (docs/benchmarks.md).

    Args:
        logits: [N, vocab_size] float32 or the model dtype, one row per sampling request (modified in place).
        bitmask: [len(rows), ceil(vocab_size / 32)] int32, xgrammar's and llguidance's layout (bit ``t % 32`` of
            word ``t // 32`` set = token ``t`` allowed); row ``i`` applies to ``logits[rows[i]]``.
        rows: distinct indices into ``logits``.
    Raises:
        ValueError: if the shapes disagree.
    """
    if bitmask.shape[0] != len(rows) or bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(f"bitmask must be [{len(rows)}, >= {logits.shape[1]} / 32], got {list(bitmask.shape)}")
    forbidden = forbidden_tokens(bitmask, logits.shape[1], logits.device)
    if rows == list(range(len(rows))):
        logits[:len(rows)].masked_fill_(forbidden, float("-inf"))
    else:
        for i, row in enumerate(rows):
            logits[row].masked_fill_(forbidden[i], float("-inf"))


def apply_step_bitmask(logits: torch.Tensor, req_ids: list[str], structured_output_request_ids: dict[str, int],
                       grammar_bitmask: np.ndarray) -> None:
    """Mask a step's logits with its ``SchedulerOutput.grammar_bitmask``.

    Args:
        logits: [N, vocab_size] float32 or the model dtype, row ``i`` for request ``req_ids[i]`` (modified in place).
        req_ids: the sampling requests in logits order.
        structured_output_request_ids: request id -> bitmask row (the message's).
        grammar_bitmask: [R, ceil(vocab_size / 32)] int32.
    Raises:
        RuntimeError: if a constrained request of the message does not sample in this batch.
    """
    position = {rid: i for i, rid in enumerate(req_ids)}
    missing = [rid for rid in structured_output_request_ids if rid not in position]
    if missing:
        raise RuntimeError(f"requests {missing[:4]} have grammar bitmask rows but do not sample this step")
    order = sorted(structured_output_request_ids.items(), key=lambda kv: kv[1])
    apply_grammar_bitmask(logits, grammar_bitmask[[row for _, row in order]], [position[rid] for rid, _ in order])
