"""The grammar engines behind structured output: one interface, chosen by name.

vLLM V1 names its backends ``"xgrammar"`` and ``"guidance"`` (llguidance) and lets ``"auto"``
pick; here ``"auto"`` is ``"guidance"``: llguidance is a dependency of pagedllm (a small wheel
with no requirements of its own), while xgrammar is an extra (``pip install 'pagedllm[xgrammar]'``;
its metadata brings triton). A backend compiles a grammar key (``grammar.grammar_key``) against
the vocabulary and gives each request its own matcher; the engine shares one bitmask array
between them (xgrammar's and llguidance's layout are the same).
"""

from __future__ import annotations

import importlib
import importlib.util
from abc import ABC, abstractmethod

import numpy as np

# "auto" resolves to the first of these; every one is a ``StructuredOutputsConfig.backend`` value.
STRUCTURED_OUTPUTS_BACKENDS = ("guidance", "xgrammar")
_MODULES = {"guidance": ("pagedllm.structured_output.backend_guidance", "GuidanceBackend"),
            "xgrammar": ("pagedllm.structured_output.backend_xgrammar", "XgrammarBackend")}


def resolve_backend_name(name: str) -> str:
    """The backend that ``name`` means: ``"auto"`` -> ``"guidance"``.

    Raises:
        ValueError: naming ``structured_outputs_backend`` for a name that is no backend.
    """
    if name == "auto":
        return STRUCTURED_OUTPUTS_BACKENDS[0]
    if name not in STRUCTURED_OUTPUTS_BACKENDS:
        raise ValueError(f"structured_outputs_backend must be one of {('auto',) + STRUCTURED_OUTPUTS_BACKENDS}, "
                         f"got {name!r}")
    return name


def get_backend_class(name: str) -> type["StructuredOutputBackend"]:
    """The backend class for ``name`` (``"auto"`` allowed), its grammar engine found installed but
    not imported (``StructuredOutputBackend.check_engine``; the first grammar imports it).

    Raises:
        ValueError: naming ``structured_outputs_backend`` when the name is unknown or its
            package is not installed (with the command that installs it).
    """
    module_name, cls_name = _MODULES[resolve_backend_name(name)]
    cls = getattr(importlib.import_module(module_name), cls_name)
    cls.check_engine()
    return cls


class GrammarMatcher(ABC):
    """One request's position in its grammar."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unusable from then on) if the grammar
        rejects it."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True when the grammar has ended: it allows nothing more (llguidance says so as soon
        as only EOS could follow; xgrammar once EOS itself is accepted)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]``.

        Args:
            bitmask: [rows, ceil(vocab_size / 32)] int32, C-contiguous; bit ``t % 32`` of word
                ``t // 32`` set = token ``t`` allowed.
            row: the row to write.
        """

    @abstractmethod
    def fork(self) -> "GrammarMatcher":
        """An independent copy at the same state (forked sequences)."""


class StructuredOutputBackend(ABC):
    """A grammar engine bound to one vocabulary.

    ``__init__`` builds the engine's view of the vocabulary (every token's bytes; seconds for a
    262,144-token vocabulary), so the manager constructs a backend in its compile pool.

    Args:
        tokenizer: the engine's ``Tokenizer`` (``get_hf_tokenizer()``, ``eos_token_ids``).
        vocab_size: the logits width (tokens; may exceed the tokenizer's vocabulary).
    """

    name: str
    # The grammar engine's modules (the first is the package returned by ``import_engine``) and
    # the pip command that installs it (error messages).
    modules: tuple[str, ...]
    install: str

    @classmethod
    def check_engine(cls) -> None:
        """That the grammar engine's modules are installed, without importing them: an engine
        start checks this, and the first grammar imports them (``llguidance.hf`` imports
        transformers, about 1.5 s of CPU that a start without constrained requests does not need).

        Raises:
            ValueError: naming ``structured_outputs_backend`` and ``install`` when one is missing.
        """
        for name in cls.modules:
            try:
                found = importlib.util.find_spec(name) is not None   # imports a dotted name's parents only
            except ImportError as e:
                raise cls._not_installed(f"{type(e).__name__}: {e}") from None
            if not found:
                raise cls._not_installed(f"no module named {name!r}")

    @classmethod
    def import_engine(cls):
        """Import the grammar engine's package and return it.

        Raises:
            ValueError: naming ``structured_outputs_backend`` and ``install`` when it is missing.
        """
        try:
            imported = [importlib.import_module(m) for m in cls.modules]
        except ImportError as e:
            raise cls._not_installed(f"{type(e).__name__}: {e}") from None
        return imported[0]

    @classmethod
    def _not_installed(cls, why: str) -> ValueError:
        """The error of ``check_engine`` and ``import_engine`` when the engine's package is missing."""
        return ValueError(f"structured_outputs_backend={cls.name!r} needs the {cls.modules[0]} package, which is "
                          f"not installed ({why}); install it with: {cls.install}")

    @classmethod
    @abstractmethod
    def validate(cls, key: tuple[str, str]) -> None:
        """Check that a grammar key compiles (no vocabulary needed: cheap, done at the edge).

        Raises:
            ValueError: naming the field (``structured_outputs.json`` / ``.regex`` / ``.choice``
                / ``.grammar``) with the engine's message.
        """

    @abstractmethod
    def __init__(self, tokenizer, vocab_size: int) -> None: ...

    @abstractmethod
    def compile(self, key: tuple[str, str]) -> object:
        """The compiled grammar of a key (shared by every request with that key).

        Raises:
            ValueError: as ``validate``.
        """

    @abstractmethod
    def new_matcher(self, compiled: object) -> GrammarMatcher:
        """A matcher at the start of ``compiled``."""


def field_of(kind: str) -> str:
    """The ``StructuredOutputsParams`` field a grammar key's kind comes from."""
    return {"json": "json", "json-compact": "json", "regex": "regex", "choice": "choice",
            "structural_tag": "structural_tag"}.get(kind, "grammar")


def compile_error(kind: str, engine: str, cause: Exception | str) -> ValueError:
    """A ``ValueError`` naming the field, with the engine's message on one line (at most 400
    characters)."""
    field = field_of(kind)
    what = {"json": "JSON schema", "regex": "regular expression", "choice": "choice list",
            "structural_tag": "structural tag"}.get(field, "grammar")
    text = " ".join(line.strip() for line in str(cause).splitlines() if line.strip())
    message = text[:400] if text else type(cause).__name__
    return ValueError(f"structured_outputs.{field}: {engine} cannot compile this {what}: {message}")
