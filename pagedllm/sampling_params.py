"""Sampling parameters with vLLM's names, defaults and validation (no torch here)."""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field
from typing import Callable, Sequence

_SAMPLING_EPS = 1e-5


class RequestOutputKind(enum.Enum):
    """How a streaming caller wants outputs: the whole text so far, or only the new part."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's ``StructuredOutputsParams``), plain data.

    Exactly one of the fields below is set. The engine compiles it with its backend (llguidance or xgrammar)
    (``pagedllm/structured_output``) and masks every step's logits to the tokens the grammar allows;
    EOS is allowed only where the grammar may end, and a grammar that allows nothing more ends the
    request (finish reason "stop").

    Attributes:
        json: a JSON schema (dict, or its JSON text); the output is JSON that validates against it.
        regex: a regular expression the whole output matches.
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (llama.cpp's GBNF, which both backends read, root rule ``root``; llguidance also reads Lark).
        json_object: any JSON object (``response_format: {"type": "json_object"}``).
        structural_tag: vLLM's structural tag (its JSON text, or the dict): ``{"structures":
            [{"begin": str, "schema": JSON schema, "end": str}, ...], "triggers": [str, ...]}``;
            free text, except that once a trigger is written the text must continue as one of
            the structures whose ``begin`` starts with it: ``begin``, JSON valid against
            ``schema``, ``end``; then free text again.
        disable_any_whitespace: JSON without free whitespace between tokens (compact separators);
            None takes the engine's default (``StructuredOutputsConfig.disable_any_whitespace``).
    Raises:
        ValueError: from ``__post_init__`` when no constraint or more than one is set, or a field
            has the wrong type (the grammar itself is checked by the input processor).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool | None = None

    def __post_init__(self) -> None:
        kinds = self.kinds
        if not kinds:
            raise ValueError("structured_outputs must set one of json, regex, choice, grammar, json_object, "
                             "structural_tag")
        if len(kinds) > 1:
            raise ValueError(f"structured_outputs must set only one kind of constraint, got {kinds}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (dict or string), got "
                             f"{type(self.json).__name__}")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError(f"structured_outputs.regex must be a string, got {type(self.regex).__name__}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError(f"structured_outputs.grammar must be a non-empty string, got {self.grammar!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not self.choice or any(
                    not isinstance(c, str) or c == "" for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                                 f"got {self.choice!r}")
            self.choice = list(self.choice)

    @property
    def kinds(self) -> list[str]:
        """The names of the constraint fields that are set."""
        return [name for name in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
                if getattr(self, name) not in (None, False)]

    @property
    def kind(self) -> str:
        """The one constraint field that is set ("json", "regex", "choice", "grammar",
        "json_object" or "structural_tag")."""
        return self.kinds[0]


# vLLM's older name.
GuidedDecodingParams = StructuredOutputsParams


# A per-step logits hook (structured output, e.g. xgrammar): called with the ids generated so far
# and the row of logits [vocab_size] float32 for this request; returns the (possibly masked) row.
LogitsProcessor = Callable[[list[int], "object"], "object"]


@dataclass
class SamplingParams:
    """How to pick tokens for one request (vLLM's ``SamplingParams``).

    Attributes:
        n: number of independent samples returned. Sample ``i`` of a request with ``seed=s`` uses
            seed ``s + i``; unseeded samples draw from the engine's generator.
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: nucleus probability mass in (0, 1]; 1 disables.
        top_k: keep the k most likely tokens; 0 or -1 disables.
        min_p: drop tokens whose probability is below ``min_p`` x the top probability; 0 disables.
        seed: per-request seed; the request's samples are then independent of the rest of the batch.
        presence_penalty, frequency_penalty: OpenAI's additive penalties on generated tokens,
            in [-2, 2].
        repetition_penalty: CTRL's multiplicative penalty (Keskar et al. 2019) on prompt and
            generated tokens; 1 disables; must be > 0.
        stop: strings that end generation; the stop string is cut from the text unless
            ``include_stop_str_in_output``.
        stop_token_ids: extra token ids that end generation (kept in ``token_ids``).
        ignore_eos: keep generating past the model's EOS ids.
        max_tokens: most tokens to generate, at least 1 (vLLM's rule); ``None`` means up to
            ``max_model_len``. For the prompt only (its ``prompt_logprobs``), ask for 1 and ignore
            it, as with vLLM; the server's ``echo`` with ``max_tokens: 0`` does this for you.
        min_tokens: EOS ids and ``stop_token_ids`` are masked until this many tokens exist.
        logprobs: number of top log-probabilities returned per generated token (plus the sampled one).
        prompt_logprobs: number of top log-probabilities returned per prompt token.
        skip_special_tokens: drop special tokens from the text.
        spaces_between_special_tokens: kept for API compatibility.
        include_stop_str_in_output: keep the matched stop string in the text.
        logit_bias: token id -> additive bias on the logit, in [-100, 100].
        allowed_token_ids: if set, only these ids can be sampled.
        bad_words_token_ids: ids that can never be sampled.
        logits_processors: per-step logits hooks (see ``LogitsProcessor``).
        structured_outputs: a grammar constraint (``StructuredOutputsParams``), or None.
        output_kind: cumulative or delta outputs when streaming.
        extra_args: free-form per-request arguments for the engine's class-based logits
            processors (vLLM's ``extra_args``; a dict, picklable for worker processes).
        trace_decode_token_ids: vLLM's trace replay (an engine with ``enable_trace_replay``): the
            tokens to emit, in order, whatever the model would sample; logprobs and ranks are still
            the model's. ``max_tokens`` becomes its length and EOS ids in it do not stop the
            request (``ignore_eos``). Needs ``n`` 1 and no ``best_of``, ``prompt_logprobs``,
            ``structured_outputs`` or ``bad_words_token_ids``.
        watermarking: whether the engine's ``watermark_config`` watermarks this request (vLLM's
            field): None (default) or True: yes where it can (a random request; greedy and trace
            replay requests are never watermarked); False: opt out. The engine resolves it to
            True / False when the request is added.
        skip_clone: vLLM's hint that the caller will not reuse these params (its engine then
            skips a deep copy); accepted, no effect here.
    Raises:
        ValueError: from ``__post_init__``, naming the field and its value, for any invalid value.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[int] | None = None
    logits_processors: list[LogitsProcessor] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict | None = None
    trace_decode_token_ids: list[int] | None = None
    watermarking: bool | None = None
    skip_clone: bool = False
    # Filled by the engine from the model: EOS ids (tokenizer EOS + model extras such as Gemma's
    # <end_of_turn>). Not part of the public API.
    _all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    _eos_token_ids: tuple[int, ...] = field(default=(), repr=False)
    # Set by the server for a completion with ``echo`` and ``max_tokens: 0`` (vLLM's
    # "echo without generation"): max_tokens is 1 and the output processor drops that token, so
    # the output has no tokens, finish reason "length". Not part of the public API.
    _prompt_only: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            try:
                self.stop = list(self.stop)
            except TypeError as e:
                raise ValueError(
                    f"stop must be a string or a list of strings, got {self.stop!r}") from e
        try:
            self.stop_token_ids = list(self.stop_token_ids or [])
        except TypeError as e:
            raise ValueError(
                f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}") from e
        if self.top_k is None:
            self.top_k = 0
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError) as e:
                raise ValueError(f"logit_bias must map token ids to floats, got {self.logit_bias!r}") from e
        self._verify()
        if self.trace_decode_token_ids is not None:
            self.trace_decode_token_ids = list(self.trace_decode_token_ids)
            self.max_tokens = len(self.trace_decode_token_ids)
            self.ignore_eos = True
        if self.temperature < _SAMPLING_EPS:
            # Greedy: sampling knobs do not apply.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self._all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        def _is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if (not isinstance(value, numbers.Real) or isinstance(value, bool)
                    or not math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            raise ValueError(f"best_of must be an int >= n ({self.n}), got {self.best_of!r}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.watermarking is not None and not isinstance(self.watermarking, bool):
            raise ValueError(f"watermarking must be None, True or False, got {self.watermarking!r}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and not _is_int(self.max_tokens):
            raise ValueError(f"max_tokens must be an int, got {self.max_tokens!r}")
        if self.max_tokens is not None and self.max_tokens < 1:   # vLLM's check and message
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be an int >= 0, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
                not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise ValueError(f"prompt_logprobs must be an int >= 0, got {self.prompt_logprobs!r}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                if tok < 0:
                    raise ValueError(f"logit_bias keys must be non-negative token ids, got {tok}")
                if not -100.0 <= bias <= 100.0:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {tok}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
            if any(not _is_int(t) or t < 0 for t in self.allowed_token_ids):
                raise ValueError(
                    f"allowed_token_ids must be non-negative ints, got {self.allowed_token_ids!r}")

        if self.bad_words_token_ids is not None and any(
                not _is_int(t) or t < 0 for t in self.bad_words_token_ids):
            raise ValueError(
                f"bad_words_token_ids must be non-negative ints, got {self.bad_words_token_ids!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        trace = self.trace_decode_token_ids
        if trace is not None:
            if isinstance(trace, (str, bytes)) or not hasattr(trace, "__len__") or len(trace) == 0:
                raise ValueError(f"trace_decode_token_ids must be a non-empty list of token ids, got {trace!r}")
            if any(not _is_int(t) or t < 0 for t in trace):
                raise ValueError(f"trace_decode_token_ids must be non-negative ints, got {list(trace)!r}")
            for name, bad in (("n", self.n != 1), ("best_of", self.best_of not in (None, 1)),
                              ("prompt_logprobs", self.prompt_logprobs is not None),
                              ("structured_outputs", self.structured_outputs is not None),
                              ("bad_words_token_ids", bool(self.bad_words_token_ids))):
                if bad:
                    raise ValueError(f"trace_decode_token_ids cannot be combined with {name} "
                                     f"(got {getattr(self, name)!r})")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict, got {type(self.extra_args).__name__}")
        if self.logits_processors is not None and any(
                not callable(f) for f in self.logits_processors):
            raise ValueError(
                f"logits_processors must be callables, got {self.logits_processors!r}")

    @property
    def sampling_type_greedy(self) -> bool:
        """True when tokens are chosen by argmax."""
        return self.temperature < _SAMPLING_EPS

    @property
    def needs_sampled_logprobs(self) -> bool:
        """Whether sampled tokens need their log-probabilities: ``logprobs`` asked, or ``best_of``
        > ``n`` (the best samples are chosen by cumulative logprob). Otherwise the engine skips
        the log-softmax normaliser and ``CompletionOutput.cumulative_logprob`` is None (as vLLM)."""
        return self.logprobs is not None or (self.best_of or self.n) > self.n

    def update_from_model(self, eos_token_ids: Sequence[int]) -> None:
        """Record the model's EOS ids (tokenizer EOS + extras); they stop generation unless
        ``ignore_eos``. ``stop_token_ids`` always stop generation."""
        self._eos_token_ids = tuple(eos_token_ids)
        stops = set(self.stop_token_ids)
        if not self.ignore_eos:
            stops.update(eos_token_ids)
        self._all_stop_token_ids = stops

    @property
    def all_stop_token_ids(self) -> set[int]:
        """Ids that finish the request when sampled (after ``min_tokens``)."""
        return self._all_stop_token_ids

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The model's EOS ids, masked while fewer than ``min_tokens`` tokens exist."""
        return self._eos_token_ids

    def clone(self) -> "SamplingParams":
        """A shallow copy (logits processors are shared)."""
        import copy
        return copy.copy(self)


@dataclass
class BeamSearchParams:
    """vLLM's ``BeamSearchParams`` (``LLM.beam_search``, ``engine/beam_search.py``).

    Attributes:
        beam_width: beams kept per step (>= 1).
        max_tokens: most generated tokens (>= 1).
        ignore_eos: keep extending beams past EOS (an EOS candidate is then an ordinary one).
        temperature: must be 0 (scores are raw log-probabilities).
        length_penalty: exponent of the length in the final score (finite).
    Raises:
        ValueError: naming the field, for a value outside those ranges.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an int >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.temperature != 0.0:
            raise ValueError(f"temperature must be 0 for beam search, got {self.temperature}")
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float)) \
                or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
