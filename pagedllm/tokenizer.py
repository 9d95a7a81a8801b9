"""Tokenizer wrapper over a ``tokenizers.Tokenizer`` (``tokenizer.json``), without transformers.

It reproduces what ``transformers.AutoTokenizer.from_pretrained(folder)`` (transformers 5, fast
tokenizers) returns for ``encode`` / ``decode``:

* BOS/EOS come only from ``tokenizer.json``'s post-processor (a ``TemplateProcessing`` such as
  ``<bos> $A``; Gemma 3's adds ``<bos>``, id 2). transformers 5.x drops ``add_bos_token`` /
  ``add_eos_token`` from ``tokenizer_config.json`` whenever ``tokenizer.json`` exists
  (``PreTrainedTokenizerBase._from_pretrained``), and with no post-processor it installs a plain
  ``$A`` template, so neither flag changes its ``encode``; we match that and log a warning when
  the flags ask for a BOS/EOS the post-processor does not add.
* ``decode`` applies ``clean_up_tokenization_spaces`` only when ``tokenizer_config.json`` asks for
  it and the model is not BPE (transformers 5 refuses it for BPE).

EOS ids for stopping (``eos_token_ids``): the tokenizer's EOS, then ``generation_config.json``'s
``eos_token_id`` (int or list), then ``config.json``'s, then ``<end_of_turn>`` when that token
exists (Gemma chat turns end with it); deduplicated, order kept.

transformers is imported only by :meth:`Tokenizer.get_hf_tokenizer` (the structured-output backends).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Iterable, Sequence
from typing import Any

import tokenizers

logger = logging.getLogger(__name__)

_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                         "cls_token", "mask_token")
_END_OF_TURN_TOKENS = ("<end_of_turn>",)
_BYTE_FALLBACK_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
# ``tokenizers``' single-text ``encode`` / ``decode`` hold the GIL for their whole run (a 2 MB text:
# ~2 s in which no other Python thread, e.g. the server's event loop, runs); the batch calls
# release it. Inputs from these sizes on (about a millisecond of work) go through the batch call
# (same result); shorter ones keep the plain call (no trip through the Rust thread pool).
_GIL_FREE_MIN_CHARS = 4096
_GIL_FREE_MIN_IDS = 8192


def find_lone_surrogate(value: Any, path: str) -> str | None:
    """Where ``value`` (a str, or dicts / lists / tuples of them, walked keys and values) holds a
    lone UTF-16 surrogate (U+D800..U+DFFF): such a ``str`` is not Unicode text, cannot be
    encoded as UTF-8, and the tokenizer rejects it (``TypeError: TextInputSequence must be
    str``). JSON lets a body carry one (``"\\ud800"``), so request text is checked first.

    Args:
        value: the value to walk.
        path: how messages name ``value`` (``"prompt"``, ``"messages[0].content"``).
    Returns:
        A message naming the path, the code point and its character index, or None if clean.
    """
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return (f"{path} holds a lone UTF-16 surrogate (U+{ord(value[e.start]):04X} at character {e.start}), "
                    "which is not valid Unicode text")
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = find_lone_surrogate(key, f"{path} key") or find_lone_surrogate(item, f"{path}.{key}")
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = find_lone_surrogate(item, f"{path}[{i}]")
            if found:
                return found
    return None


def check_text(value: Any, path: str) -> None:
    """Raises:
        ValueError: naming ``path``, when ``value`` holds a lone surrogate (``find_lone_surrogate``)."""
    found = find_lone_surrogate(value, path)
    if found:
        raise ValueError(found)


def _byte_level_decoding_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character standing for each byte
    (``tokenizers.pre_tokenizers.ByteLevel.alphabet()``, in GPT-2's ``bytes_to_unicode`` order)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + \
        list(range(ord("\u00ae"), ord("\u00ff") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        value = json.load(f)
    return value if isinstance(value, dict) else {}


def _token_content(value: Any) -> str | None:
    """A special token entry of tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, Iterable):
        return [int(v) for v in value if v is not None]
    return []


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``PreTrainedTokenizerBase.clean_up_tokenization``."""
    return (text.replace(" .", ".").replace(" ?", "?").replace(" !", "!").replace(" ,", ",")
            .replace(" ' ", "'").replace(" n't", "n't").replace(" 'm", "'m").replace(" 's", "'s")
            .replace(" 've", "'ve").replace(" 're", "'re"))


class Tokenizer:
    """Text <-> token ids for one model folder.

    Attributes:
        backend: the ``tokenizers.Tokenizer`` loaded from ``tokenizer.json``.
        folder: the folder it was loaded from.
        bos_token_id, eos_token_id, pad_token_id, unk_token_id: ids of the named special tokens
            from ``tokenizer_config.json`` (``None`` when absent or not in the vocabulary).
        eos_token_ids: ids that end generation (see the module docstring).
        all_special_ids: ids of every special token (named ones, extra ones, and added tokens
            marked special in ``tokenizer.json``).
        vocab_size: vocabulary size including added tokens.
        chat_template: Jinja chat template from ``chat_template.jinja`` or
            ``tokenizer_config.json``; ``None`` when the model has none.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        tokenizer_config: dict[str, Any],
        generation_config: dict[str, Any] | None = None,
        model_config: dict[str, Any] | None = None,
        folder: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        """Wrap a backend tokenizer (prefer :meth:`from_pretrained`).

        Args:
            backend: a ``tokenizers.Tokenizer``, used as is.
            tokenizer_config: contents of ``tokenizer_config.json``.
            generation_config: contents of ``generation_config.json``, if any.
            model_config: contents of ``config.json``, if any.
            folder: where the files came from (for :meth:`get_hf_tokenizer`).
            chat_template: overrides the template in ``tokenizer_config``.
        """
        self.backend = backend
        self.folder = folder
        self._tokenizer_config = dict(tokenizer_config)
        self._hf_tokenizer = None
        self._byte_level_table: dict[str, int] | None = None  # built on first token_bytes call

        self.special_tokens: dict[str, str] = {}
        for name in _NAMED_SPECIAL_TOKENS:
            content = _token_content(tokenizer_config.get(name))
            if content is not None:
                self.special_tokens[name] = content
        self.bos_token_id = self._named_id("bos_token")
        self.eos_token_id = self._named_id("eos_token")
        self.pad_token_id = self._named_id("pad_token")
        self.unk_token_id = self._named_id("unk_token")

        self._warn_on_ignored_bos_eos_flags()

        special: set[int] = set()
        for content in self.special_tokens.values():
            if (token_id := backend.token_to_id(content)) is not None:
                special.add(token_id)
        extra = tokenizer_config.get("extra_special_tokens") or tokenizer_config.get(
            "additional_special_tokens") or []
        if isinstance(extra, dict):
            extra = list(extra.values())
        for item in extra:
            content = _token_content(item)
            if content is not None and (token_id := backend.token_to_id(content)) is not None:
                special.add(token_id)
        for token_id, added in backend.get_added_tokens_decoder().items():
            if added.special:
                special.add(token_id)
        self.all_special_ids: set[int] = special

        eos_ids: list[int] = []
        candidates = [self.eos_token_id]
        candidates += _as_id_list((generation_config or {}).get("eos_token_id"))
        candidates += _as_id_list((model_config or {}).get("eos_token_id"))
        candidates += [backend.token_to_id(token) for token in _END_OF_TURN_TOKENS]
        for token_id in candidates:
            if token_id is not None and token_id not in eos_ids:
                eos_ids.append(token_id)
        self.eos_token_ids: list[int] = eos_ids

        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        template = chat_template if chat_template is not None else tokenizer_config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        self.chat_template: str | None = template if isinstance(template, str) else None
        # config.json's model_type: picks a chat-template fallback for a model without one.
        self.model_type: str | None = (model_config or {}).get("model_type")

        self._clean_up_spaces = bool(tokenizer_config.get("clean_up_tokenization_spaces", False)) and (
            type(backend.model).__name__ != "BPE"
            or bool(tokenizer_config.get(
                "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)))

    def _named_id(self, name: str) -> int | None:
        content = self.special_tokens.get(name)
        return None if content is None else self.backend.token_to_id(content)

    def _warn_on_ignored_bos_eos_flags(self) -> None:
        """Warn when tokenizer_config.json asks for BOS/EOS that tokenizer.json does not add."""
        probe = self.backend.encode("", add_special_tokens=True).ids
        for flag, token_id in (("add_bos_token", self.bos_token_id), ("add_eos_token", self.eos_token_id)):
            if self._tokenizer_config.get(flag) and token_id is not None and token_id not in probe:
                logger.warning(
                    "%s: tokenizer_config.json sets %s=true but tokenizer.json's post-processor does "
                    "not add token %d; following transformers 5, which ignores the flag",
                    self.folder, flag, token_id)

    @classmethod
    def from_pretrained(cls, folder: str) -> "Tokenizer":
        """Load ``tokenizer.json`` + ``tokenizer_config.json`` (+ ``generation_config.json``,
        ``config.json``, ``chat_template.jinja``) from an HF-style folder.

        Raises:
            ValueError: if the folder has no ``tokenizer.json`` (slow-only tokenizers such as a bare
                ``tokenizer.model`` are not supported).
        """
        t0 = time.perf_counter()
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(f"tokenizer folder {folder!r} has no tokenizer.json")
        backend = tokenizers.Tokenizer.from_file(path)
        tokenizer_config = _read_json(os.path.join(folder, "tokenizer_config.json"))
        chat_template = None
        template_path = os.path.join(folder, "chat_template.jinja")
        if os.path.isfile(template_path):
            with open(template_path, encoding="utf-8") as f:
                chat_template = f.read()
        elif os.path.isfile(os.path.join(folder, "chat_template.json")):
            chat_template = _read_json(os.path.join(folder, "chat_template.json")).get("chat_template")
        tokenizer = cls(
            backend,
            tokenizer_config,
            generation_config=_read_json(os.path.join(folder, "generation_config.json")),
            model_config=_read_json(os.path.join(folder, "config.json")),
            folder=folder,
            chat_template=chat_template,
        )
        logger.info("loaded tokenizer from %s in %.2f s (vocab %d, eos ids %s)",
                    folder, time.perf_counter() - t0, tokenizer.vocab_size, tokenizer.eos_token_ids)
        return tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the post-processor adds BOS/EOS
        (equal to ``transformers.AutoTokenizer.from_pretrained(folder).encode(text)``). A long
        text is encoded without holding the GIL, so other threads keep running meanwhile."""
        if len(text) >= _GIL_FREE_MIN_CHARS:
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """:meth:`encode` for many texts (parallel in the Rust backend)."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (equal to transformers' ``decode`` with the same flag); many ids are
        decoded without holding the GIL."""
        if len(ids) >= _GIL_FREE_MIN_IDS:
            text = self.backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]
        else:
            text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

    def batch_decode(self, ids_list: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        """:meth:`decode` of each id list (transformers' ``batch_decode``; one Rust call, GIL-free)."""
        texts = self.backend.decode_batch([list(ids) for ids in ids_list], skip_special_tokens=skip_special_tokens)
        return [_clean_up_tokenization(t) for t in texts] if self._clean_up_spaces else texts

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token adds to decoded text (special tokens: their written form).

        A byte-fallback piece (``<0xF0>``) is its one byte; with a byte-level decoder (GPT-2 style
        BPE) each character of the piece stands for one byte; otherwise the token's decoded text in
        UTF-8. A token may hold part of a character, so the result need not be valid UTF-8.

        Raises:
            ValueError: for an id outside the vocabulary.
        """
        piece = self.backend.id_to_token(int(token_id))
        if piece is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        if int(token_id) in self.all_special_ids:
            return piece.encode("utf-8")
        if (m := _BYTE_FALLBACK_PIECE.match(piece)) is not None:
            return bytes([int(m.group(1), 16)])
        if self._byte_level_table is None:
            decoder = self.backend.decoder
            state = decoder.__getstate__() if decoder is not None else b""
            self._byte_level_table = _byte_level_decoding_table() if b'"ByteLevel"' in state else {}
        if self._byte_level_table and all(c in self._byte_level_table for c in piece):
            return bytes(self._byte_level_table[c] for c in piece)
        return self.backend.decode([int(token_id)], skip_special_tokens=False).encode("utf-8")

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Vocabulary strings of ``ids`` (e.g. ``"▁Hello"``); raises ValueError for unknown ids."""
        tokens = []
        for token_id in ids:
            token = self.backend.id_to_token(int(token_id))
            if token is None:
                raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
            tokens.append(token)
        return tokens

    def convert_tokens_to_ids(self, tokens: Sequence[str]) -> list[int | None]:
        """Ids of vocabulary strings; ``None`` for strings not in the vocabulary."""
        return [self.backend.token_to_id(token) for token in tokens]

    def get_hf_tokenizer(self):
        """A ``transformers.PreTrainedTokenizerFast`` for the same folder (what the structured-output
        backends, xgrammar and llguidance, read their vocabulary from).

        Built lazily on first call (imports transformers); the chat template found here is set on
        it when transformers did not load one. The generic fast class, not ``AutoTokenizer``'s
        model class: the same ``tokenizer.json`` and ``tokenizer_config.json`` (vocabulary, added
        and special tokens) in half the time (Gemma 3's 262k vocabulary: ~4 s instead of ~9 s).

        Raises:
            ValueError: if this tokenizer was not loaded from a folder.
        """
        if self._hf_tokenizer is None:
            if self.folder is None:
                raise ValueError("get_hf_tokenizer needs a Tokenizer loaded with from_pretrained(folder)")
            from transformers import PreTrainedTokenizerFast

            hf_tokenizer = PreTrainedTokenizerFast.from_pretrained(self.folder)
            if getattr(hf_tokenizer, "chat_template", None) is None and self.chat_template is not None:
                hf_tokenizer.chat_template = self.chat_template
            self._hf_tokenizer = hf_tokenizer
        return self._hf_tokenizer

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (f"Tokenizer(folder={self.folder!r}, vocab_size={self.vocab_size}, "
                f"bos={self.bos_token_id}, eos={self.eos_token_ids})")
