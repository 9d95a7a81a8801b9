"""Apply the step's grammar bitmask to the logits, where the worker samples (torch only)."""

from __future__ import annotations

import numpy as np
import torch


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> None:
    """Set the logits of tokens the grammar forbids to -inf, in place, in one call.

    The rows are masked where they lie (xgrammar's ``indices``): no copy of the constrained
    logits rows out and back (``index_select`` of a [k, 262144] float32 block allocated and
    faulted in k MiB each step, several times the mask itself; docs/benchmarks.md).

    Args:
        logits: [N, vocab_size] float32, one row per sampling request (modified in place).
        bitmask: [len(rows), ceil(vocab_size / 32)] int32, xgrammar's layout (bit ``t % 32`` of
            word ``t // 32`` set = token ``t`` allowed); row ``i`` applies to ``logits[rows[i]]``.
        rows: distinct indices into ``logits``.
    Raises:
        ValueError: if the shapes disagree.
    """
    import xgrammar as xgr

    if bitmask.shape[0] != len(rows) or bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(f"bitmask must be [{len(rows)}, >= {logits.shape[1]} / 32], got {list(bitmask.shape)}")
    mask = torch.from_numpy(np.ascontiguousarray(bitmask))                  # [k, W] int32
    if rows != list(range(len(rows))):  # xgrammar reads bitmask[i] for logits[i]: lay the rows out so
        full = torch.empty((logits.shape[0], mask.shape[1]), dtype=torch.int32)  # [N, W], only rows read
        full[torch.as_tensor(rows, dtype=torch.int64)] = mask
        mask = full
    mask = mask.to(logits.device)
    backend = "cpu" if logits.device.type == "cpu" else "torch_native"
    xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[1], indices=list(rows), backend=backend)


def apply_step_bitmask(logits: torch.Tensor, req_ids: list[str], structured_output_request_ids: dict[str, int],
                       grammar_bitmask: np.ndarray) -> None:
    """Mask a step's logits with its ``SchedulerOutput.grammar_bitmask``.

    Args:
        logits: [N, vocab_size] float32, row ``i`` for request ``req_ids[i]`` (modified in place).
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
