"""Run under torchrun by ``test_external_launcher.py``: every rank builds the same ``LLM`` with
``distributed_executor_backend="external_launcher"``, generates its data-parallel share of the
prompts and writes ``rank{RANK}.json`` (dp rank, dp size, KV blocks, the rank in vLLM's ``get_world_group().cpu_group``,
this rank's model parameters reached as vLLM's example does, request index -> token ids, the
JSON-constrained tokens of the first two prompts) to OUT_DIR.

Usage: ``torchrun --nproc-per-node=N torchrun_driver.py MODEL OUT_DIR TP PP DP TEMPERATURE
[PROMPTS_JSON MAX_TOKENS]``: MODEL "default" is the default model (256-token context, 64 MiB KV);
PROMPTS_JSON a file with a list of prompts' token ids instead of ``PROMPTS``; MAX_TOKENS default 10.
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.parallel_state import get_world_group
from pagedllm.sampling_params import StructuredOutputsParams

# Three prompts: a repeated 24-token one, a short one and a 40-token one (as parallel_utils.PROMPTS),
# and one more so that two data-parallel ranks get two each.
PROMPTS = [[5, 9, 13, 200, 17, 3, 3, 40] * 3, [7, 8, 9], list(range(30, 70)), [11, 12, 13, 14, 15]]
# [structured output] the first two prompts again under this JSON schema (the bitmask filled beside the forward).
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}


def constrained_params(temperature: float, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(json=SCHEMA))


def _only_42(token_ids: list[int], logits):
    keep = logits[42].clone()
    logits.fill_(float("-inf"))
    logits[42] = keep
    return logits


def _generate(llm: LLM, model: str, prompts: list[list[int]], mine: list[int], temperature: float,
              max_tokens: int) -> dict:
    """This rank's share of the prompts, the forced-token request and (tiny model) the constrained ones."""
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompts[i]} for i in mine], params, use_tqdm=False)
    # A logits processor (a callable, applied where the engine's driver samples) that allows only token 42.
    forced = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                          SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True,
                                         logits_processors=[_only_42]), use_tqdm=False)
    # [structured output] on the tiny model only (the default model's vocabulary takes ~10 s to index).
    constrained = [] if model == "default" else llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:2]], constrained_params(temperature, max_tokens), use_tqdm=False)
    return {"forced": list(forced[0].outputs[0].token_ids),
            "constrained": [list(o.outputs[0].token_ids) for o in constrained],
            "tokens": {str(i): list(o.outputs[0].token_ids) for i, o in zip(mine, outputs)}}


def main(model: str, out_dir: str, tp: int, pp: int, dp: int, temperature: float, prompts: list[list[int]],
         max_tokens: int) -> None:
    size = dict(model=None, max_model_len=256, kv_cache_memory_bytes=64 << 20) if model == "default" else \
        dict(model=model, max_model_len=128, block_size=8, kv_cache_memory_bytes=4 << 20)
    llm = LLM(**size, dtype="float32", seed=1, tensor_parallel_size=tp, pipeline_parallel_size=pp,
              data_parallel_size=dp, distributed_executor_backend="external_launcher")
    config = llm.llm_engine.vllm_config.parallel_config
    mine = [i for i in range(len(prompts)) if i % config.data_parallel_size == config.data_parallel_rank]
    result = {"dp_rank": config.data_parallel_rank, "dp_size": config.data_parallel_size,
              "num_blocks": llm.llm_engine.num_blocks,
              "world_rank": dist.get_rank(group=get_world_group().cpu_group),
              "num_params": sum(p.numel() for p in
                                llm.llm_engine.model_executor.driver_worker.worker.model_runner.model.parameters()),
              **_generate(llm, model, prompts, mine, temperature, max_tokens)}
    if model != "default" and temperature == 0.0:
        # The same requests sampled (temperature 0.8) by the same engine: every rank must agree.
        result["sampled"] = _generate(llm, model, prompts, mine, 0.8, max_tokens)
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    given = json.loads(open(sys.argv[7]).read()) if len(sys.argv) > 7 else PROMPTS
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]), given,
         int(sys.argv[8]) if len(sys.argv) > 8 else 10)
