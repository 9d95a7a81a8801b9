"""vLLM's "async_llm_streaming" example: AsyncLLM with DELTA outputs, printed as they arrive."""

import asyncio

from pagedllm import SamplingParams
from pagedllm.engine.arg_utils import AsyncEngineArgs
from pagedllm.sampling_params import RequestOutputKind
from pagedllm.v1.engine.async_llm import AsyncLLM


async def stream_response(engine: AsyncLLM, prompt: str, request_id: str) -> str:
    print(f"\n Prompt: {prompt!r}")
    print(" Response: ", end="", flush=True)
    sampling_params = SamplingParams(max_tokens=16, temperature=0.0, output_kind=RequestOutputKind.DELTA)
    text = ""
    async for output in engine.generate(request_id=request_id, prompt=prompt, sampling_params=sampling_params):
        for completion in output.outputs:
            print(completion.text, end="", flush=True)
            text += completion.text
        if output.finished:
            print("\n Done!")
            break
    return text


async def main():
    engine_args = AsyncEngineArgs(model="default", enforce_eager=True)
    engine = AsyncLLM.from_engine_args(engine_args)
    try:
        prompts = ["The future of artificial intelligence is", "In a galaxy far, far away", "The key to happiness is"]
        for i, prompt in enumerate(prompts):
            await stream_response(engine, prompt, f"stream-example-{i}")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
