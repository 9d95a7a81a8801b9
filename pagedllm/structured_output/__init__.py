"""Grammar-constrained decoding with xgrammar (vLLM V1's ``vllm/v1/structured_output``).

- ``grammar``: ``StructuredOutputsParams`` -> an ``xgrammar.Grammar`` and its cache key; the
  check every request passes at the edge (a bad schema / regex / grammar is a ``ValueError``).
- ``manager``: ``StructuredOutputManager`` in the engine: the tokenizer info (built once), an LRU
  of compiled grammars compiled in a thread pool, one matcher per request, the per-step bitmask.
- ``request``: ``StructuredOutputRequest``, the opaque handle a ``core.Request`` holds.
- ``bitmask``: ``apply_grammar_bitmask``, where the worker masks the logits before sampling.

``import xgrammar`` imports torch, so ``core/`` never imports this package; it calls the handle's
methods (``core.request.StructuredOutputHandle``).
"""
