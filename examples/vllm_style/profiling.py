"""vLLM's "simple_profiling" example: a torch profiler trace of the engine's steps."""

import os
import sys

from pagedllm import LLM, SamplingParams


def main(trace_dir: str):
    llm = LLM(model="default", profiler_config={"profiler": "torch", "torch_profiler_dir": trace_dir})
    llm.start_profile()
    outputs = llm.generate(["Hello, my name is", "The capital of France is"], SamplingParams(max_tokens=8))
    llm.stop_profile()
    for output in outputs:
        print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")
    print("Traces:", sorted(os.listdir(trace_dir)))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "./traces")
