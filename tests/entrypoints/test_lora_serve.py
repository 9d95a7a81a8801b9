"""``pagedllm serve --enable-lora`` started for real (the engine in its own process): the adapters of
``--lora-modules`` answer through the openai client as the offline engine does with the same
adapter, and an adapter that cannot be loaded at run time (``/v1/load_lora_adapter``) is a 400
naming what is wrong while the server keeps serving (it used to kill the engine process)."""

import httpx
import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

PROMPT = [5, 17, 42, 9, 33, 71, 8]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _adapter(base: str, out: str, seed: int, **config) -> str:
    """A PEFT LoRA adapter with random (seeded) A and B, saved by PEFT."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0, bias="none",
                                      task_type="CAUSAL_LM", **config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.save_pretrained(out)
    return out


def test_serve_with_lora_modules_and_runtime_loading(launch_server, make_tiny_checkpoint, tmp_path):
    from pagedllm import LLM, LoRARequest, SamplingParams
    from pagedllm.sampling_params import BeamSearchParams

    base = make_tiny_checkpoint("llama")
    a, b = _adapter(base, str(tmp_path / "a"), 1), _adapter(base, str(tmp_path / "b"), 2)
    dora = _adapter(base, str(tmp_path / "dora"), 3, use_dora=True)
    engine_flags = ["--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory-bytes", "4MiB",
                    "--no-enable-prefix-caching"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(base, dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20, enable_prefix_caching=False,
              enable_lora=True, max_loras=2, max_lora_rank=16)
    want = {name: llm.generate([PROMPT], params, lora_request=lora)[0].outputs[0].text
            for name, lora in (("tiny", None), ("a", LoRARequest("a", 1, a)), ("b", LoRARequest("b", 2, b)))}
    assert len(set(want.values())) == 3   # the adapters change the text
    with pytest.raises(ValueError, match="lora_request"):
        llm.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=2), lora_request=LoRARequest("a", 1, a))
    del llm

    server = launch_server(["serve", base, "--served-model-name", "tiny", *engine_flags, "--enable-lora",
                            "--max-loras", "2", "--lora-modules", f"a={a}", "--enable-runtime-lora-updating"],
                           "lora_server", module="pagedllm.entrypoints.cli")
    client = server.client()

    def complete(model: str) -> str:
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    models = {m.id: m for m in client.models.list().data}
    assert models["a"].model_extra["parent"] == "tiny"
    assert complete("a") == want["a"] and complete("tiny") == want["tiny"]
    for path, fragment in ((str(tmp_path / "missing"), "adapter_config.json"), (dora, "use_dora")):
        r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": path}, timeout=60)
        assert r.status_code == 400, r.text
        assert fragment in r.json()["error"]["message"] and r.json()["error"]["param"] == "lora_path"
    assert "bad" not in {m.id for m in client.models.list().data}
    assert complete("a") == want["a"]   # the engine lives on
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": b}, timeout=60)
    assert r.status_code == 200, r.text
    assert complete("b") == want["b"]
    assert server.proc.poll() is None
