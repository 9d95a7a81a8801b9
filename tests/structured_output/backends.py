"""The structured-output backends the tests run over, and references built from each grammar
engine's own API (not pagedllm's wrappers): a matcher over a JSON schema and a string check."""

from __future__ import annotations

import importlib.util
import json

import pytest

XGRAMMAR_MISSING = importlib.util.find_spec("xgrammar") is None
# Every backend, as pytest params: xgrammar (an extra) skips, naming the package, when missing.
BACKENDS = ["guidance", pytest.param("xgrammar", marks=pytest.mark.skipif(
    XGRAMMAR_MISSING, reason="xgrammar is not installed (pip install 'pagedllm[xgrammar]')"))]
# llguidance's JSON options for compact output (pagedllm's default disable_any_whitespace=True).
GUIDANCE_COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class ReferenceMatcher:
    """A fresh matcher of the backend's own library over a compact JSON schema.

    ``allowed()`` is the next-token mask as a [vocab] bool torch tensor, unpacked here from the
    library's own bitmask fill.
    """

    def __init__(self, backend: str, hf_tokenizer, vocab_size: int, eos_ids: list[int], schema: dict) -> None:
        self.backend, self.vocab_size = backend, vocab_size
        if backend == "xgrammar":
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=eos_ids)
            compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                                     separators=(",", ":"))
            self.matcher = xgr.GrammarMatcher(compiled)
            self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        else:
            import llguidance
            import llguidance.hf
            import llguidance.torch

            tok = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos_ids)
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=GUIDANCE_COMPACT)
            self.matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
            assert not self.matcher.is_error(), self.matcher.get_error()
            self.bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)

    def allowed(self):
        import torch

        if self.backend == "xgrammar":
            self.matcher.fill_next_token_bitmask(self.bitmask)
        else:
            import llguidance.torch

            llguidance.torch.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        bits = (self.bitmask[0].to(torch.int64).unsqueeze(-1) >> torch.arange(32)) & 1
        return bits.reshape(-1)[:self.vocab_size].bool()

    def accept(self, token_id: int) -> bool:
        if self.backend == "xgrammar":
            return self.matcher.accept_token(token_id)
        return self.matcher.consume_token(token_id)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated() if self.backend == "xgrammar" else self.matcher.is_stopped()
