"""Model-based drafts (``SpeculativeConfig.method`` "draft_model" / "self_int8"): a draft model
that runs on the driver worker right after the target's verification, with its own paged KV pool.

The draft's K/V tensors have the target's ``num_blocks`` and ``block_size`` and are indexed by the
same block tables and slots (``worker.py`` allocates them beside the target's), so the scheduler's
blocks serve both models: they are allocated, shared, copied on write and freed with the request,
and the scheduler only adds ``num_lookahead_tokens`` slots for the draft's writes past the step's
tokens (``core/scheduler.py``). Drafts are greedy (the draft's argmax: a point-mass ``q``), which the
target's rejection rule (``worker/model_runner.py`` ``_accept_drafts``) verifies exactly, so the
draft's quality only changes the speed.

Engine side (no weights): ``draft_model_config`` (the draft's ``ModelConfig``) and
``check_draft_tokenizer`` (a draft must share the target's tokenizer). Worker side:
``DraftModel.propose``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedllm.config import ModelConfig, SpeculativeConfig


def draft_model_config(spec: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
    """The draft's ``ModelConfig``: for "self_int8" the target's with ``quantization=
    "int8_weight_only"``; for "draft_model" the architecture of ``spec.model``'s config.json with
    the target's run settings (dtype, device, seed) and ``spec.quantization``. The draft is built
    with the target's ``KernelConfig`` (``Worker.load_draft_model``) and has no exact greedy head.

    Raises:
        ValueError: naming ``speculative_config``: "self_int8" on a target that is not a float32
            or bfloat16 CPU model (the int8 weight-only kernels are CPU only), or a draft model
            that cannot be resolved (as ``loaders.resolve_model``) or is not a supported
            architecture.
    """
    if spec.method == "self_int8":
        if target.quantization is not None and target.quantization != "gguf":
            raise ValueError(f"speculative_config: method 'self_int8' drafts with the target's weights in "
                             f"int8_weight_only; the target already runs quantization={target.quantization!r}")
        try:
            return dataclasses.replace(target, quantization="int8_weight_only")
        except ValueError as e:
            raise ValueError(f"speculative_config: method 'self_int8': {e}") from e
    from pagedllm.loaders.hf_config import hf_architecture_fields
    from pagedllm.loaders import load_config, resolve_model

    try:
        files = resolve_model(spec.model)
        return dataclasses.replace(target, model=spec.model, tokenizer=None, model_folder=files.folder,
                                   quantization=spec.quantization, load_format="auto", model_loader_extra_config=None,
                                   **hf_architecture_fields(load_config(files.folder)))
    except ValueError as e:
        raise ValueError(f"speculative_config: draft model {spec.model!r}: {e}") from e


def check_draft_tokenizer(target_tokenizer, draft_folder: str, draft_model: str) -> None:
    """Raise unless the draft's tokenizer (in ``draft_folder``) maps every id to the target's
    token: same size, same tokens by id, same EOS id (drafts are token ids of the target).

    Raises:
        ValueError: naming ``speculative_config.model`` and the first difference.
    """
    from pagedllm.tokenizer import Tokenizer

    draft = Tokenizer.from_pretrained(draft_folder)
    n_t, n_d = len(target_tokenizer), len(draft)
    if n_t != n_d:
        raise ValueError(f"speculative_config: draft model {draft_model!r} has a tokenizer of {n_d} tokens, "
                         f"the target's has {n_t}; a draft model must share the target's tokenizer")
    ids = list(range(n_t))
    mine, theirs = target_tokenizer.convert_ids_to_tokens(ids), draft.convert_ids_to_tokens(ids)
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            raise ValueError(f"speculative_config: draft model {draft_model!r}: token id {i} is {b!r} in its "
                             f"tokenizer and {a!r} in the target's; a draft model must share the target's tokenizer")
    if target_tokenizer.eos_token_id != draft.eos_token_id:
        raise ValueError(f"speculative_config: draft model {draft_model!r}: EOS id {draft.eos_token_id} differs "
                         f"from the target's {target_tokenizer.eos_token_id}")


@dataclass
class DraftInput:
    """One request to draft for.

    Attributes:
        req_id: the request.
        token_ids: its real tokens (prompt, outputs, this step's accepted drafts and new token; L).
        start: tokens whose draft K/V is valid (0 <= start < L); the draft computes ``[start, L)``.
        block_table: its physical blocks; covers ``L + num_drafts - 1`` tokens.
        num_drafts: drafts wanted (>= 1).
    """

    req_id: str
    token_ids: list[int]
    start: int
    block_table: list[int]
    num_drafts: int


class DraftModel:
    """The draft model and its KV pool on the driver worker.

    Args:
        model: a registered model (``forward`` / ``compute_logits``), unsharded.
        kv_caches: per draft layer (k_cache, v_cache), each [num_blocks, block_size, Hkv_d, D_d]
            in the draft's dtype, ``num_blocks`` as the target's pool.
        block_size: tokens per block.
        device: where the model lives.
        vocab_size: the target's vocabulary (tokens): drafts are argmaxes over ``[0, vocab_size)``.
        max_model_len: tokens per request; no draft K/V is written at or past it.
    """

    def __init__(self, model, kv_caches: list, block_size: int, device, vocab_size: int,
                 max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.vocab_size = vocab_size

    def propose(self, items: list[DraftInput]) -> list[list[int]]:
        """Greedy drafts for each item, batched: one prefill-like forward over each item's tokens
        ``[start, L)`` (the last position's argmax is draft 1), then ``max(num_drafts) - 1``
        single-token forwards (draft ``j`` at position ``L + j - 2`` gives draft ``j + 1``).
        Writes draft K/V at positions ``[start, L + num_drafts - 1)`` (the last draft's K/V is not
        written).

        Returns:
            Per item, ``num_drafts`` token ids.
        """
        import torch

        from pagedllm.attention.ops import build_attention_metadata

        if not items:
            return []
        with torch.inference_mode():
            query_lens = [len(it.token_ids) - it.start for it in items]
            context_lens = [it.start for it in items]
            tables = [it.block_table for it in items]
            input_ids = torch.tensor([t for it in items for t in it.token_ids[it.start:]], dtype=torch.int64,
                                     device=self.device)
            positions = torch.tensor([p for it in items for p in range(it.start, len(it.token_ids))],
                                     dtype=torch.int64, device=self.device)
            md = build_attention_metadata(query_lens, context_lens, tables, self.block_size, self.device)
            hidden = self.model(input_ids, positions, self.kv_caches, md)              # [T, H]
            last = torch.tensor(list(_ends(query_lens)), dtype=torch.int64, device=self.device)
            drafts = [[t] for t in self._argmax(hidden[last])]
            active = list(range(len(items)))
            for j in range(1, max(it.num_drafts for it in items)):
                active = [i for i in active if items[i].num_drafts > j]
                pos = [len(items[i].token_ids) + j - 1 for i in active]                 # draft j's position
                md = build_attention_metadata([1] * len(active), pos, [tables[i] for i in active],
                                              self.block_size, self.device)
                ids_pos = torch.tensor([*(drafts[i][-1] for i in active), *pos], dtype=torch.int64,
                                       device=self.device)
                hidden = self.model(ids_pos[:len(active)], ids_pos[len(active):], self.kv_caches, md)  # [A, H]
                for i, t in zip(active, self._argmax(hidden)):
                    drafts[i].append(t)
        return drafts

    def _argmax(self, hidden) -> list[int]:
        logits = self.model.compute_logits(hidden)                                     # [N, V_d]
        return logits[:, :self.vocab_size].argmax(dim=-1).tolist()


def _ends(lengths: list[int]):
    total = 0
    for n in lengths:
        total += n
        yield total - 1
