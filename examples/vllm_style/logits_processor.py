"""vLLM's "logits_processor/custom.py" example: a class-based logits processor (vLLM V1's interface)
that forces each request's ``extra_args["target_token"]``; requests without one are untouched."""

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from pagedllm.v1.sample.logits_processor.builtin import process_dict_updates


class DummyLogitsProcessor(LogitsProcessor):
    """Fake logit processor to support unit testing and examples"""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.req_info: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None):
        process_dict_updates(self.req_info, batch_update,
                             lambda params, _, __: params.extra_args and params.extra_args.get("target_token"))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.req_info:
            return logits
        cols = torch.tensor(list(self.req_info.values()), dtype=torch.long, device=logits.device)
        rows = torch.tensor(list(self.req_info.keys()), dtype=torch.long, device=logits.device)
        values_to_keep = logits[rows, cols].clone()
        logits[rows] = float("-inf")
        logits[rows, cols] = values_to_keep
        return logits


prompts = ["Hello, my name is", "The president of the United States is", "The capital of France is",
           "The future of AI is"]
sampling_params_list = [
    SamplingParams(temperature=0.0, max_tokens=6, extra_args={"target_token": 67}),
    SamplingParams(temperature=0.0, max_tokens=6),
    SamplingParams(temperature=0.0, max_tokens=6, extra_args={"target_token": 42}),
    SamplingParams(temperature=0.0, max_tokens=6),
]


def main():
    llm = LLM(model="default", logits_processors=[DummyLogitsProcessor])
    outputs = llm.generate(prompts, sampling_params_list)
    for output in outputs:
        print(f"Prompt: {output.prompt!r}, Generated token ids: {list(output.outputs[0].token_ids)}")


if __name__ == "__main__":
    main()
