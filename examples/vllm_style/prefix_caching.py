"""vLLM's "prefix_caching" example: the same prompts with and without automatic prefix caching
give the same answers, the second engine reusing the shared prefix's KV blocks."""

from pagedllm import LLM, SamplingParams
from pagedllm.distributed import cleanup_dist_env_and_memory

prefix = (
    "You are an expert school principal, skilled in effectively managing faculty and staff. Draft 10-15 "
    "questions for a potential first grade Head Teacher for my K-12, all-girls', independent school that "
    "emphasizes community, joyful discovery, and life-long learning. The candidate is coming in for a "
    "first-round panel interview for a 8th grade Math teaching role. They have 5 years of previous teaching "
    "experience as an assistant teacher at a co-ed, public school with experience in middle school math "
    "teaching. Based on these information, fulfill the following paragraph: ")
prompts = ["Hello, my name is", "The president of the United States is", "The capital of France is",
           "The future of AI is"]
generating_prompts = [prefix + prompt for prompt in prompts]
sampling_params = SamplingParams(temperature=0.0, max_tokens=12)


def main():
    # float32: its greedy tokens do not depend on the batch on any CPU (README, "Offline API").
    regular_llm = LLM(model="default", dtype="float32", enable_prefix_caching=False)
    outputs = regular_llm.generate(generating_prompts, sampling_params)
    regular_generated_texts = [output.outputs[0].text for output in outputs]
    # Destroy the LLM object and free up memory before the next engine (as vLLM's example does).
    del regular_llm
    cleanup_dist_env_and_memory()

    prefix_cached_llm = LLM(model="default", dtype="float32", enable_prefix_caching=True)
    prefix_cached_llm.generate(generating_prompts[0], sampling_params)   # warm the cache
    outputs = prefix_cached_llm.generate(generating_prompts, sampling_params)
    cached_generated_texts = [output.outputs[0].text for output in outputs]
    for output in outputs:
        print(f"Prompt: {output.prompt[-40:]!r}, cached tokens: {output.num_cached_tokens}, "
              f"Generated text: {output.outputs[0].text!r}")
    print(f"Generated answers are the same: {regular_generated_texts == cached_generated_texts}")


if __name__ == "__main__":
    main()
