"""vLLM's "llm_engine_example": EngineArgs from the command line, then the engine's step loop."""

from pagedllm import EngineArgs, LLMEngine, RequestOutput, SamplingParams
from pagedllm.utils import FlexibleArgumentParser


def create_test_prompts() -> list[tuple[str, SamplingParams]]:
    return [
        ("A robot may not injure a human being", SamplingParams(temperature=0.0, max_tokens=8)),
        ("To be or not to be,", SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2, max_tokens=8, seed=1)),
        ("What is the meaning of life?", SamplingParams(n=2, temperature=0.8, top_p=0.95, frequency_penalty=0.1,
                                                        max_tokens=8, seed=2)),
    ]


def process_requests(engine: LLMEngine, test_prompts: list[tuple[str, SamplingParams]]):
    request_id = 0
    print("-" * 50)
    while test_prompts or engine.has_unfinished_requests():
        if test_prompts:
            prompt, sampling_params = test_prompts.pop(0)
            engine.add_request(str(request_id), prompt, sampling_params)
            request_id += 1
        request_outputs: list[RequestOutput] = engine.step()
        for request_output in request_outputs:
            if request_output.finished:
                print(request_output)
                print("-" * 50)


def parse_args():
    parser = FlexibleArgumentParser(description="Demo on using the LLMEngine class directly")
    parser = EngineArgs.add_cli_args(parser)
    return parser.parse_args()


def main(args):
    engine_args = EngineArgs.from_cli_args(args)
    engine = LLMEngine.from_engine_args(engine_args)
    process_requests(engine, create_test_prompts())


if __name__ == "__main__":
    main(parse_args())
