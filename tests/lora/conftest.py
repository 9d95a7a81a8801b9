"""Adapters for the LoRA tests: random (seeded) PEFT LoRA weights on the tiny checkpoints, saved
with PEFT's own ``save_pretrained`` (so the files are exactly what PEFT writes)."""

import pytest
from lora_utils import NEW_TOKENS, PROMPTS

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _make_adapter(base_dir: str, out_dir: str, seed: int, r: int = 8, alpha: float = 16.0,
                  targets=None, use_rslora: bool = False, scale: float = 0.3) -> str:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets or ALL_TARGETS), lora_dropout=0.0,
                        bias="none", use_rslora=use_rslora, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:   # PEFT inits B to 0: make both random
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    peft_model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def make_adapter(tmp_path_factory):
    """Factory: (base folder, seed, **LoraConfig fields) -> a PEFT adapter folder (cached)."""
    cache: dict = {}

    def make(base_dir: str, seed: int, **kwargs) -> str:
        key = (base_dir, seed, tuple(sorted((k, str(v)) for k, v in kwargs.items())))
        if key not in cache:
            cache[key] = _make_adapter(base_dir, str(tmp_path_factory.mktemp(f"lora{seed}")), seed, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def peft_greedy():
    """(base folder, adapter folder or None, prompts, max_new_tokens) -> (greedy ids, their
    logprobs) of transformers + ``PeftModel.from_pretrained`` (unmerged), each prompt alone, EOS
    ignored."""

    def run(base_dir: str, adapter_dir: str | None, prompts: list[list[int]], max_new_tokens: int):
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        if adapter_dir is not None:
            model = PeftModel.from_pretrained(model, adapter_dir)
        model.eval()
        ids, logprobs = [], []
        with torch.inference_mode():
            for prompt in prompts:
                x = torch.tensor([prompt])
                out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                     min_new_tokens=0, do_sample=False, eos_token_id=None, pad_token_id=0,
                                     output_scores=True, return_dict_in_generate=True)
                toks = out.sequences[0, len(prompt):].tolist()
                ids.append(toks)
                logprobs.append([torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, toks)])
        return ids, logprobs

    return run


@pytest.fixture(scope="session")
def llama_lora(make_tiny_checkpoint, make_adapter, peft_greedy):
    """The tiny Llama, three adapters (ranks 8 / 4 / 16: all seven targets / q,v,down /
    k,o,gate,up with rsLoRA) and PEFT's greedy ids for ``PROMPTS``: dict with ``base``,
    ``adapters``, ``refs`` (per adapter, per prompt), ``base_ref``."""
    base = make_tiny_checkpoint("llama")
    adapters = [make_adapter(base, 1, r=8), make_adapter(base, 2, r=4, targets=["q_proj", "v_proj", "down_proj"]),
                make_adapter(base, 3, r=16, alpha=8.0, use_rslora=True,
                             targets=["k_proj", "o_proj", "up_proj", "gate_proj"])]
    return {"base": base, "adapters": adapters,
            "refs": [peft_greedy(base, a, PROMPTS, NEW_TOKENS)[0] for a in adapters],
            "base_ref": peft_greedy(base, None, PROMPTS, NEW_TOKENS)[0]}
