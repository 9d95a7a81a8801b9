"""Grammar-constrained decoding (vLLM V1's ``vllm/v1/structured_output``).

- ``grammar``: ``StructuredOutputsParams`` -> a backend-neutral grammar key (canonical text; the
  compile cache's key) and the edge check every request passes (a bad schema / regex / grammar is
  a ``ValueError``); ``$ref`` checks.
- ``backend``: the backend interface (compile a key against the vocabulary, one matcher per
  request) and the choice by name ("auto" = "guidance").
- ``backend_guidance``: llguidance (the default, a dependency); ``backend_xgrammar``: xgrammar
  (the ``xgrammar`` extra).
- ``manager``: ``StructuredOutputManager`` in the engine: the backend (built once), an LRU of
  compiled grammars compiled in a thread pool, the per-step bitmask.
- ``request``: ``StructuredOutputRequest``, the opaque handle a ``core.Request`` holds.
- ``bitmask``: ``apply_grammar_bitmask``, where the worker masks the logits before sampling.

The grammar engines import torch or numpy, so ``core/`` never imports this package; it calls the
handle's methods (``core.request.StructuredOutputHandle``).
"""
