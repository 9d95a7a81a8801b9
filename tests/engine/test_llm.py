"""The offline API on a tiny random Llama: arguments, prompt forms, sampling features, errors."""

from __future__ import annotations

import json
import math

import pytest

from pagedllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(make_tiny_checkpoint):
    return LLM(make_tiny_checkpoint("llama"), dtype="float32", max_model_len=128, kv_cache_memory_bytes=32 << 20, seed=0)


def _free_all(llm):
    m = llm.llm_engine.kv_cache_manager
    return m.num_free_blocks == m.num_blocks


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def test_unknown_and_unsupported_arguments_raise_value_error(make_tiny_checkpoint):
    path = make_tiny_checkpoint("llama")
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM(path, not_an_argument=1)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(path, tensor_parallel_size=3)   # 4 heads do not split 3 ways
    with pytest.raises(ValueError, match="dtype"):
        LLM(path, dtype="int3")
    with pytest.raises(ValueError, match="block_size"):
        LLM(path, block_size=0)


def test_kv_budget_too_small_says_largest_max_model_len(make_tiny_checkpoint):
    path = make_tiny_checkpoint("llama")
    # 3 layers * 2 * 2 kv heads * 16 dims * 4 bytes = 768 B/token; 16 KiB hold 21 tokens -> 1 block of 16.
    with pytest.raises(ValueError, match=r"max_model_len <= 16"):
        LLM(path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=16 << 10)


def test_hybrid_kv_budget_too_small_says_largest_max_model_len(make_tiny_checkpoint):
    path = make_tiny_checkpoint("gemma3")   # two groups of 2 layers: full and a window of 8 tokens
    # A request of L tokens holds cdiv(L, 16) full blocks + min(cdiv(L, 16), cdiv(8 - 1 + 1, 16) + 1)
    # window blocks, plus the pool's null block: 128 tokens need 8 + 2 + 1 = 11 pages; 5 pages hold
    # L = 32 (2 + 2 + 1), not 48 (3 + 2 + 1).
    with pytest.raises(ValueError, match=r"holds 5 blocks .*needs \(11 blocks.*max_model_len <= 32 "):
        LLM(path, dtype="float32", max_model_len=128, block_size=16, num_gpu_blocks_override=5)


def test_vllm_compat_arguments_are_accepted(make_tiny_checkpoint):
    llm = LLM(make_tiny_checkpoint("llama"), dtype="float32", max_model_len=64, kv_cache_memory_bytes=8 << 20,
              trust_remote_code=True, enforce_eager=True, tensor_parallel_size=1, gpu_memory_utilization=0.5,
              tokenizer=make_tiny_checkpoint("llama"))
    assert llm.generate("hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_prompt_forms_are_equivalent(llm):
    tok = llm.get_tokenizer()
    text = "The quick brown fox"
    ids = tok.encode(text)
    outs = llm.generate([text, ids, {"prompt_token_ids": ids}, {"prompt": text}], GREEDY, use_tqdm=False)
    assert outs[0].prompt == text and outs[1].prompt is None
    assert all(o.prompt_token_ids == ids for o in outs)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert outs[0].outputs[0].text == tok.decode(outs[0].outputs[0].token_ids)


def test_outputs_in_input_order_with_per_prompt_params(llm):
    prompts = ["a", "The quick brown fox jumps", "blocks of a fixed number"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 7, 5)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 7, 5]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(prompts, params[:2], use_tqdm=False)


def test_prompt_over_max_model_len_is_rejected_before_anything_runs(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=r"129 tokens long, longer than max_model_len=128"):
        llm.generate(["fine", {"prompt_token_ids": [5] * 129}], GREEDY, use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert _free_all(llm)


def test_bad_prompts_raise_value_error(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt token ids"):
        llm.generate([{"prompt_token_ids": [1, 10_000_000]}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(["x"], SamplingParams(logit_bias={10_000_000: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate(["x"], SamplingParams(logprobs=21), use_tqdm=False)


def test_max_model_len_caps_generation(llm):
    out = llm.generate({"prompt_token_ids": [5] * 120}, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].finish_reason == "length"


def test_stop_string_cut_and_kept(llm):
    base = llm.generate("The quick", GREEDY, use_tqdm=False)[0].outputs[0]
    text = base.text
    assert len(text) > 6
    stop = text[3:6]
    first = text.find(stop)
    out = llm.generate("The quick", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:first]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate("The quick", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=[stop],
                                                    include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[:first + len(stop)]
    assert _free_all(llm)


def test_stop_token_ids(llm):
    base = llm.generate("The quick", GREEDY, use_tqdm=False)[0].outputs[0]
    stop_id = base.token_ids[3]
    first = base.token_ids.index(stop_id)
    out = llm.generate("The quick", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                   stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    late = llm.generate("The quick", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, min_tokens=first + 2,
                                                    stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) >= first + 2


def test_logprobs_and_cumulative_logprob(llm):
    out = llm.generate("The quick", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3,
                                                   prompt_logprobs=2), use_tqdm=False)[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 6
    chosen = [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)]
    assert math.isclose(comp.cumulative_logprob, sum(chosen), rel_tol=1e-5, abs_tol=1e-5)
    for lp, t in zip(comp.logprobs, comp.token_ids):
        assert lp[t].rank == 1 and 3 <= len(lp) <= 4
        assert max(v.logprob for v in lp.values()) == lp[t].logprob
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None
    for lp, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:]):
        assert t in lp and lp[t].logprob <= 0


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=42, ignore_eos=True)
    alone = llm.generate("The quick", params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    mixed = llm.generate(["x y z", "The quick", "blocks"], [others, params, others], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone


def test_n_samples_use_documented_seeds(llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7, ignore_eos=True)
    out = llm.generate("The quick", params, use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    for i, o in enumerate(out.outputs):
        single = llm.generate("The quick", SamplingParams(temperature=1.0, max_tokens=8, seed=7 + i, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0]
        assert o.token_ids == single.token_ids
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert _free_all(llm)


def test_best_of_returns_highest_cumulative_logprob(llm):
    params = SamplingParams(n=2, best_of=4, temperature=1.0, max_tokens=6, seed=3, ignore_eos=True)
    out = llm.generate("The quick", params, use_tqdm=False)[0]
    assert len(out.outputs) == 2
    everything = llm.generate("The quick", SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=3, ignore_eos=True,
                                                          logprobs=0),
                              use_tqdm=False)[0]
    best = sorted((o.cumulative_logprob for o in everything.outputs), reverse=True)[:2]
    assert [o.cumulative_logprob for o in out.outputs] == pytest.approx(best)


def test_abort_frees_blocks_and_engine_keeps_serving(llm):
    engine = llm.llm_engine
    engine.add_request("victim", "The quick brown fox", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("survivor", "blocks of a", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    engine.step()
    assert engine.kv_cache_manager.num_free_blocks < engine.kv_cache_manager.num_blocks
    final = engine.abort_request("victim")
    assert final[0].finished and final[0].outputs[0].finish_reason == "abort"
    assert engine.scheduler.get_request("victim") is None
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["survivor"]
    assert len(done[0].outputs[0].token_ids) == 5
    assert _free_all(llm)


def test_cli_generate_jsonl(make_tiny_checkpoint, tmp_path, capsys):
    from pagedllm.entrypoints.cli import main
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "The quick", "max_tokens": 4}) + "\n"
                       + json.dumps({"prompt_token_ids": [5, 6, 7]}) + "\n")
    out_file = tmp_path / "out.jsonl"
    rc = main(["generate", "--model", make_tiny_checkpoint("llama"), "--prompts-file", str(prompts),
               "--output-format", "jsonl", "--output-file", str(out_file), "--max-tokens", "6", "--ignore-eos",
               "--max-model-len", "64", "--kv-cache-memory-bytes", "8MiB", "--no-progress",
               "--dtype", "float32"])
    assert rc == 0
    rows = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [len(r["outputs"][0]["token_ids"]) for r in rows] == [4, 6]
    assert rows[1]["prompt_token_ids"] == [5, 6, 7]
    assert "output tokens/s" in capsys.readouterr().err


def test_cli_reports_bad_arguments(capsys):
    from pagedllm.entrypoints.cli import main
    assert main(["generate"]) == 2
    assert "no prompts" in capsys.readouterr().err


def _byte_token_ids(tokenizer, data: bytes) -> list[int]:
    from pagedllm.tokenizer import _byte_level_decoding_table

    char_of = {b: c for c, b in _byte_level_decoding_table().items()}
    return [tokenizer.backend.token_to_id(char_of[b]) for b in data]


def test_prompt_ending_inside_a_character_gives_only_generated_text(llm):
    tok = llm.get_tokenizer()
    head = tok.encode("Hello world", add_special_tokens=False)
    euro = _byte_token_ids(tok, "€".encode())
    other = tok.encode(" the", add_special_tokens=False)[:1]
    for split in (1, 2):
        prompt = head + euro[:split]
        # The generated bytes complete the prompt's character: the text is that character only.
        completes = SamplingParams(temperature=0.0, max_tokens=len(euro) - split, allowed_token_ids=euro[split:])
        if split == 2:
            out = llm.generate([prompt], completes, use_tqdm=False)[0].outputs[0]
            assert out.token_ids == euro[2:] and out.text == "€"
        # They do not: the prompt's dangling bytes are dropped, never a U+FFFD.
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, allowed_token_ids=other),
                           use_tqdm=False)[0].outputs[0]
        assert out.token_ids == other and out.text == tok.decode(other)


def test_max_tokens_zero_is_refused_and_one_scores_the_prompt(llm):
    """vLLM's rule (``SamplingParams._verify_args``): max_tokens must be at least 1, same message;
    the prompt's logprobs come with max_tokens=1 (the server's echo with max_tokens 0 drops that token)."""
    for bad in (0, -3):
        with pytest.raises(ValueError, match=f"max_tokens must be at least 1, got {bad}"):
            SamplingParams(max_tokens=bad)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2, logprobs=1)
    out = llm.generate(["The quick brown fox", [5, 6, 7]], params, use_tqdm=False)
    for o, n_prompt in zip(out, (len(llm.get_tokenizer().encode("The quick brown fox")), 3)):
        assert o.finished and len(o.prompt_token_ids) == n_prompt
        assert len(o.outputs[0].token_ids) == 1 and len(o.outputs[0].logprobs) == 1
        assert o.outputs[0].finish_reason == "length"
        assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == n_prompt
        assert all(entry is not None for entry in o.prompt_logprobs[1:])
    assert _free_all(llm)


def test_lone_surrogate_is_a_value_error_naming_the_field(llm):
    """A str with a lone UTF-16 surrogate is not text the tokenizer takes (it raised a TypeError):
    a ValueError naming the prompt (or the message), nothing queued, the engine serves on."""
    with pytest.raises(ValueError, match=r"prompt holds a lone UTF-16 surrogate \(U\+D800 at character 3\)"):
        llm.generate(["abc\ud800def"], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt holds a lone UTF-16 surrogate \(U\+DFFF"):
        llm.generate([{"prompt": "\udfff"}], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match=r"messages\[1\]\.content holds a lone UTF-16 surrogate"):
        llm.chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x\udc00"}],
                 SamplingParams(max_tokens=2), chat_template="{{ messages[0]['content'] }}", use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate(["The quick brown fox"], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    assert _free_all(llm)


def test_streamed_prompt_logprobs_come_once_and_complete_under_chunked_prefill(make_tiny_checkpoint):
    from pagedllm.sampling_params import RequestOutputKind

    small = LLM(make_tiny_checkpoint("llama"), dtype="float32", max_model_len=128, max_num_batched_tokens=8,
                kv_cache_memory_bytes=8 << 20, seed=0)
    engine = small.llm_engine
    prompt = list(range(10, 40))  # 30 tokens: four prefill chunks of at most 8
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    engine.add_request("r", prompt, params)
    sent = []
    while engine.has_unfinished_requests():
        sent += [list(o.prompt_logprobs) for o in engine.step() if o.prompt_logprobs is not None]
    assert len(sent) == 1 and len(sent[0]) == len(prompt)
    assert sent[0][0] is None and all(entry is not None for entry in sent[0][1:])
