"""Model Runner V2 logits processors (``pagedllm.v1.worker.gpu.sample.logits_processor``) in a
real engine: a V2 ban equals the same ban as a V1 processor (greedy float32), the token buffer a
processor reads is prompt + outputs so far at every step (slot recycling and preemption
included), ``validate_params`` refuses a request naming its argument, V1 and V2 classes mix, and
a DRY-style penalty (what vLLM's ``features/logits_processor/dry.py`` does) reads the buffer."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.v1.sample.logits_processor import BatchUpdate
from pagedllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor
from pagedllm.v1.sample.logits_processor.builtin import process_dict_updates
from pagedllm.v1.worker.gpu.sample.logits_processor import (LogitsContext, LogitsProcessor,
                                                            LogitsProcRequestState)

ENGINE_KW = dict(dtype="float32", max_model_len=48, seed=0, block_size=4)
PROMPTS = ["Hello, my name is", "The quick brown fox", "A paged KV cache", "Numbers 0123456789", "blocks"]


def _ban_ids(params, key: str):
    ids = (params.extra_args or {}).get(key)
    if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids)):
        raise ValueError(f"extra_args.{key} must be a list of token ids, got {ids!r}")
    return ids


class BanV1(V1LogitsProcessor):
    """V1: the tokens of ``extra_args["ban"]`` at -inf."""

    def __init__(self, vllm_config, device, is_pin_memory):
        self.bans: dict[int, list[int]] = {}

    @classmethod
    def validate_params(cls, params):
        _ban_ids(params, "ban")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None):
        process_dict_updates(self.bans, batch_update, lambda p, _prompt, _out: _ban_ids(p, "ban"))

    def apply(self, logits):
        for row, ids in self.bans.items():
            logits[row, ids] = float("-inf")
        return logits


class BanV2(LogitsProcessor):
    """V2: the tokens of ``extra_args["ban2"]`` at -inf; records, at every apply, each row's tag
    (``extra_args["tag"]``), slot, lengths and buffer tokens."""

    def __init__(self, vllm_config, req_states: LogitsProcRequestState):
        self.req_states = req_states
        self.bans: list[list[int] | None] = [None] * req_states.max_num_reqs
        self.tags: list[object] = [None] * req_states.max_num_reqs
        self.seen: list[dict] = []
        self.adds: list[tuple[int, object]] = []

    @classmethod
    def validate_params(cls, params):
        _ban_ids(params, "ban2")

    def add_request(self, req_idx, params) -> bool:
        self.bans[req_idx] = _ban_ids(params, "ban2")       # overwrites the slot's last occupant
        self.tags[req_idx] = (params.extra_args or {}).get("tag")
        self.adds.append((req_idx, self.tags[req_idx]))
        return self.bans[req_idx] is not None

    def apply(self, logits, ctx: LogitsContext):
        rs = self.req_states
        assert logits.dtype == torch.float32 and logits.shape == (len(ctx.idx_mapping_np), rs.vocab_size)
        assert torch.equal(ctx.idx_mapping.cpu(), torch.from_numpy(ctx.idx_mapping_np))
        for row, slot in enumerate(ctx.idx_mapping_np.tolist()):
            n = int(ctx.seq_lens_upper_bound_np[row])
            assert int(rs.total_len.gpu[slot]) == n == int(ctx.pos[row]) + 1
            tokens = rs.all_token_ids.gpu[slot, :n].tolist()
            assert int(ctx.input_ids[row]) == tokens[-1]
            self.seen.append(dict(tag=self.tags[slot], slot=slot, tokens=tokens,
                                  prompt_len=int(rs.prompt_len.gpu[slot]), prefill_len=int(rs.prefill_len.gpu[slot])))
            if self.bans[slot] is not None:
                logits[row, self.bans[slot]] = float("-inf")
        return logits


def _v2(llm) -> BanV2:
    return llm.llm_engine.executor.driver_worker.model_runner.batch_logits_processors.v2.processors[0]


def _check_buffers(seen: list[dict], outs) -> None:
    """Every recorded buffer is the request's prompt + its first k outputs, k = 0, 1, 2, ..."""
    by_tag = {}
    for rec in seen:
        by_tag.setdefault(rec["tag"], []).append(rec)
    for tag, out in enumerate(outs):
        want = list(out.prompt_token_ids)
        recs = by_tag[tag]
        assert [r["tokens"] for r in recs] == [want + out.outputs[0].token_ids[:k] for k in range(len(recs))]
        assert len(recs) == len(out.outputs[0].token_ids)
        assert all(r["prompt_len"] == len(want) for r in recs)


@pytest.fixture(scope="module")
def path(make_tiny_checkpoint):
    return make_tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def plain(make_tiny_checkpoint):
    engine = LLM(make_tiny_checkpoint("llama"), **ENGINE_KW)
    yield engine
    engine.llm_engine.shutdown()


def _params(i: int, ban: list[int] | None, key: str, max_tokens: int = 10) -> SamplingParams:
    extra = {"tag": i}
    if ban is not None:
        extra[key] = ban
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra)


def test_v2_ban_equals_v1_ban_for_the_requests_that_asked_and_slots_recycle(path, plain):
    base = plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    # Ban each asking request's first two plain tokens, so the ban changes its output.
    bans = [list(dict.fromkeys(o.outputs[0].token_ids[:2])) if i % 2 == 0 else None for i, o in enumerate(base)]
    v1 = LLM(path, **ENGINE_KW, logits_processors=[BanV1])
    want = v1.generate(PROMPTS, [_params(i, b, "ban") for i, b in enumerate(bans)], use_tqdm=False)
    v1.llm_engine.shutdown()
    # max_num_seqs=2: five requests through two slots, each taken over by the next request.
    v2 = LLM(path, **ENGINE_KW, max_num_seqs=2, logits_processors=[BanV2])
    got = v2.generate(PROMPTS, [_params(i, b, "ban2") for i, b in enumerate(bans)], use_tqdm=False)
    for i, (g, w, b) in enumerate(zip(got, want, base)):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        if bans[i] is None:
            assert g.outputs[0].token_ids == b.outputs[0].token_ids      # untouched: the plain engine's
        else:
            assert not set(bans[i]) & set(g.outputs[0].token_ids)
            assert g.outputs[0].token_ids != b.outputs[0].token_ids
    proc = _v2(v2)
    assert {slot for slot, _ in proc.adds} == {0, 1} and sorted(tag for _, tag in proc.adds) == list(range(5))
    assert {r["slot"] for r in proc.seen} == {0, 1}
    _check_buffers(proc.seen, got)
    assert all(r["prefill_len"] == r["prompt_len"] for r in proc.seen)    # no preemption here
    v2.llm_engine.shutdown()


def test_buffers_stay_right_across_preemption(path, plain):
    params = [_params(i, [7, 8] if i % 2 else None, "ban2", max_tokens=30) for i in range(4)]
    want_plain = plain.generate(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                                use_tqdm=False)
    # 14 blocks of 4 tokens for four requests of ~35 tokens: recompute preemptions.
    v2 = LLM(path, **ENGINE_KW, num_gpu_blocks_override=14, logits_processors=[BanV2])
    got = v2.generate(PROMPTS[:4], params, use_tqdm=False)
    assert v2.llm_engine.scheduler.num_preemptions_total > 0
    proc = _v2(v2)
    _check_buffers(proc.seen, got)
    resumed = [r for r in proc.seen if r["prefill_len"] > r["prompt_len"]]
    assert resumed    # a resumed request's slot was refilled with prompt + its outputs so far
    assert len(proc.adds) > 4
    for i, out in enumerate(got):
        if i % 2 == 0:
            assert out.outputs[0].token_ids == want_plain[i].outputs[0].token_ids
        else:
            assert not {7, 8} & set(out.outputs[0].token_ids)
    v2.llm_engine.shutdown()


def test_validate_params_refuses_the_request_naming_the_argument(path):
    v2 = LLM(path, **ENGINE_KW, logits_processors=[BanV2])
    with pytest.raises(ValueError, match="extra_args.ban2"):
        v2.generate("x", SamplingParams(extra_args={"ban2": "seven"}), use_tqdm=False)
    out = v2.generate("x", SamplingParams(max_tokens=2, ignore_eos=True, extra_args={"tag": 0}), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2       # the engine goes on
    v2.llm_engine.shutdown()


def test_v1_and_v2_classes_mix_in_one_list(path, plain):
    base = plain.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    a = [o.outputs[0].token_ids[0] for o in base]
    b = [o.outputs[0].token_ids[1] for o in base]
    v1 = LLM(path, **ENGINE_KW, logits_processors=[BanV1])
    want = v1.generate(PROMPTS[:3], [_params(i, [a[i], b[i]], "ban", 8) for i in range(3)], use_tqdm=False)
    v1.llm_engine.shutdown()
    mixed = LLM(path, **ENGINE_KW, logits_processors=[BanV2, BanV1])
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                             extra_args={"tag": i, "ban": [a[i]], "ban2": [b[i]]}) for i in range(3)]
    got = mixed.generate(PROMPTS[:3], params, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    with pytest.raises(ValueError, match="extra_args.ban"):     # both classes validate
        mixed.generate("x", SamplingParams(extra_args={"ban": 3}), use_tqdm=False)
    mixed.llm_engine.shutdown()



def test_v2_processors_run_on_the_sampling_rank_of_worker_processes(path, plain):
    """The multiprocess executor (2 tensor ranks): the classes travel by name; only the sampling
    rank builds the slots and buffers; outputs equal the in-process engine's."""
    base = plain.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    bans = [base[0].outputs[0].token_ids[:1], None]
    mp = LLM(path, **ENGINE_KW, distributed_executor_backend="mp", tensor_parallel_size=2,
             logits_processors=[BanV2, BanV1])
    try:
        got = mp.generate(PROMPTS[:2], [_params(i, b, "ban2", 6) for i, b in enumerate(bans)], use_tqdm=False)
    finally:
        mp.llm_engine.shutdown()
    one = LLM(path, **ENGINE_KW, logits_processors=[BanV2])
    want = one.generate(PROMPTS[:2], [_params(i, b, "ban2", 6) for i, b in enumerate(bans)], use_tqdm=False)
    one.llm_engine.shutdown()
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert got[0].outputs[0].token_ids != base[0].outputs[0].token_ids
    assert got[1].outputs[0].token_ids == base[1].outputs[0].token_ids

# -- a DRY-style penalty (the shape of vLLM's dry.py, small) ------------------------------------

def dry_penalties(tokens: list[int], multiplier: float, base: float, allowed: int) -> dict[int, float]:
    """Token -> penalty: a token that would extend a repeat of the sequence's suffix of length
    ``L >= allowed`` loses ``multiplier * base ** (L - allowed)`` (the longest such repeat)."""
    n, out = len(tokens), {}
    for i in range(n - 1):           # the suffix ending at n-1 against the one ending at i
        length = 0
        while length <= i and tokens[i - length] == tokens[n - 1 - length]:
            length += 1
        if length >= allowed:
            pen = multiplier * base ** (length - allowed)
            out[tokens[i + 1]] = max(out.get(tokens[i + 1], 0.0), pen)
    return out


def _dry_args(params):
    return (params.extra_args or {}).get("dry_multiplier")


class DryV2(LogitsProcessor):
    """DRY (allowed length 1, base 1.75) over the V2 token buffer, windows read at
    ``ctx.seq_lens_upper_bound_np``."""

    def __init__(self, vllm_config, req_states):
        if vllm_config.speculative_config is not None:
            raise ValueError("no speculative decoding")
        self.req_states = req_states
        self.mult = np.zeros(req_states.max_num_reqs, dtype=np.float32)

    @classmethod
    def validate_params(cls, params):
        m = _dry_args(params)
        if m is not None and not (isinstance(m, (int, float)) and m >= 0):
            raise ValueError(f"dry_multiplier must be >= 0, got {m!r}")

    def add_request(self, req_idx, params) -> bool:
        self.mult[req_idx] = _dry_args(params) or 0.0
        return bool(self.mult[req_idx])

    def apply(self, logits, ctx):
        for row in np.flatnonzero(self.mult[ctx.idx_mapping_np]):
            slot, n = int(ctx.idx_mapping_np[row]), int(ctx.seq_lens_upper_bound_np[row])
            tokens = self.req_states.all_token_ids.gpu[slot, :n].tolist()
            for tok, pen in dry_penalties(tokens, float(self.mult[slot]), 1.75, 1).items():
                logits[row, tok] -= pen
        return logits


class DryV1(V1LogitsProcessor):
    """The same penalty over V1's prompt + live output ids."""

    def __init__(self, vllm_config, device, is_pin_memory):
        self.reqs: dict[int, tuple[float, list[int], list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update):
        process_dict_updates(self.reqs, batch_update,
                             lambda p, prompt, out: (_dry_args(p), prompt, out) if _dry_args(p) else None)

    def apply(self, logits):
        for row, (mult, prompt, out) in self.reqs.items():
            for tok, pen in dry_penalties(list(prompt) + list(out), float(np.float32(mult)), 1.75, 1).items():
                logits[row, tok] -= pen
        return logits


def test_dry_style_penalty_over_the_buffer_equals_its_v1_form(path, plain):
    # Prompts [s, t, s] whose plain greedy next token is t again (t: the plain token after [s]):
    # a repeat of length 1 that DRY (allowed length 1) charges.
    one = SamplingParams(temperature=0, max_tokens=1)
    starts = list(range(3, 60))
    after = [o.outputs[0].token_ids[0] for o in plain.generate([{"prompt_token_ids": [s]} for s in starts], one,
                                                               use_tqdm=False)]
    again = plain.generate([{"prompt_token_ids": [s, t, s]} for s, t in zip(starts, after)], one, use_tqdm=False)
    repeats = [[s, t, s] for s, t, o in zip(starts, after, again) if o.outputs[0].token_ids[0] == t][:2]
    assert len(repeats) == 2
    prompts = [{"prompt_token_ids": r} for r in repeats] + [{"prompt_token_ids": [90]}]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                             extra_args={"dry_multiplier": 1e4} if i < 2 else None) for i in range(3)]
    base = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    v1 = LLM(path, **ENGINE_KW, logits_processors=[DryV1])
    want = v1.generate(prompts, params, use_tqdm=False)
    v1.llm_engine.shutdown()
    v2 = LLM(path, **ENGINE_KW, max_num_seqs=2, logits_processors=[DryV2])
    got = v2.generate(prompts, params, use_tqdm=False)
    v2.llm_engine.shutdown()
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert got[2].outputs[0].token_ids == base[2].outputs[0].token_ids
    for r, g, b in zip(repeats, got, base):
        assert b.outputs[0].token_ids[0] == r[1] != g.outputs[0].token_ids[0]     # the repeat is broken
        tokens = r + g.outputs[0].token_ids
        assert all(dry_penalties(tokens[:k], 1.0, 1.75, 1).get(tokens[k]) is None for k in range(3, len(tokens)))


class RefuseThirteen(LogitsProcessor):
    """Refuses ``max_tokens=13`` at admission (the server sends no ``extra_args``)."""

    @classmethod
    def validate_params(cls, params):
        if params.max_tokens == 13:
            raise ValueError("max_tokens=13 is refused by RefuseThirteen")

    def apply(self, logits, ctx):
        return logits


def test_server_answers_a_refused_request_with_400(path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "entrypoints"))   # the server tests' helper
    from asgi_utils import run_with_clients

    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.entrypoints.openai.api_server import build_state

    args = EngineArgs(model=path, dtype="float32", max_model_len=48, block_size=4, kv_cache_memory_bytes=4 << 20,
                      seed=0, logits_processors=[RefuseThirteen])
    state = build_state(args, ["tiny"], log_requests=False, log_stats_interval_s=None)

    async def calls(client, http):
        bad = await http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 13})
        good = await http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        return bad, good

    try:
        bad, good = run_with_clients(state, calls)
    finally:
        state.engine.shutdown()
    assert bad.status_code == 400 and "RefuseThirteen" in bad.json()["error"]["message"]
    assert good.status_code == 200


# -- the slots alone (no engine) -------------------------------------------------------------

def _message(scheduled=(), finished=(), preempted=(), resumed=()):
    from types import SimpleNamespace
    return SimpleNamespace(num_scheduled_tokens={rid: 1 for rid in scheduled}, finished_req_ids=set(finished),
                           preempted_req_ids=set(preempted),
                           scheduled_cached_reqs=[SimpleNamespace(req_id=r, resumed_from_preemption=True) for r in resumed])


def test_slots_take_the_lowest_free_one_and_refuse_past_max_num_reqs():
    from pagedllm.sample.v2_logits_processors import V2LogitsProcessors
    from pagedllm.worker.request_states import CachedRequestState

    class Adds(LogitsProcessor):
        def __init__(self, vllm_config, req_states):
            self.adds = []

        def add_request(self, req_idx, params):
            self.adds.append((req_idx, params.extra_args["tag"]))
            return True

        def apply(self, logits, ctx):
            return logits

    v2 = V2LogitsProcessors.build([Adds], None, torch.device("cpu"), max_num_reqs=2, max_model_len=8, vocab_size=5)
    proc, rs = v2.processors[0], v2.req_states
    assert rs.all_token_ids.gpu.shape == (2, 8) and rs.all_token_ids.gpu.dtype == torch.int32

    def state(rid, prompt, out=()):
        return CachedRequestState(req_id=rid, prompt_token_ids=list(prompt), sampling_params=SamplingParams(
            extra_args={"tag": rid}), token_ids=list(prompt) + list(out), output_token_ids=list(out), block_ids=[],
            num_computed_tokens=0)

    reqs = {"a": state("a", [1, 2]), "b": state("b", [3])}
    v2.update_slots(_message(["a", "b"]), reqs)
    assert v2.slots == {"a": 0, "b": 1} and proc.adds == [(0, "a"), (1, "b")]
    reqs["c"] = state("c", [4, 4, 4])
    with pytest.raises(RuntimeError, match="2 of 2 held"):
        v2.update_slots(_message(["c"]), reqs)
    reqs["a"].token_ids.append(7)
    v2.update_slots(_message(["a", "c"], finished=["b"]), reqs)        # b's slot 1 goes to c
    assert v2.slots == {"a": 0, "c": 1} and proc.adds[-1] == (1, "c")
    assert rs.all_token_ids.gpu[0, :3].tolist() == [1, 2, 7] and rs.total_len.gpu.tolist() == [3, 3]
    reqs["a"].token_ids += [8, 9]
    v2.update_slots(_message(["c"], preempted=["a"]), reqs)
    v2.update_slots(_message(["a"], resumed=["a"]), reqs)               # a resumes: slot 0 again, refilled
    assert v2.slots["a"] == 0 and proc.adds[-1] == (0, "a")
    assert rs.all_token_ids.gpu[0, :5].tolist() == [1, 2, 7, 8, 9]
    assert (rs.prompt_len.gpu[0], rs.prefill_len.gpu[0], rs.total_len.gpu[0]) == (2, 5, 5)
    ctx = v2.prepare([reqs["c"], reqs["a"]])
    assert ctx.idx_mapping_np.tolist() == [1, 0] and ctx.seq_lens_upper_bound_np.tolist() == [3, 5]
    assert ctx.input_ids.tolist() == [4, 9] and ctx.pos.tolist() == [2, 4]
    with pytest.raises(RuntimeError, match="3 rows"):
        v2.apply(torch.zeros(3, 5))
