"""vLLM's offline "chat" example: one conversation and a batch of them through the model's chat template."""

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.chat_utils import load_chat_template


def main():
    llm = LLM(model="default")
    sampling_params = SamplingParams(temperature=0, max_tokens=12)
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    # The default model is a base model without a chat template: pass one, as vLLM's example can
    # (its --chat-template-path); pagedllm bundles Gemma's.
    chat_template = load_chat_template("gemma")
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False, chat_template=chat_template)
    for output in outputs:
        print(f"Prompt: {output.prompt!r}")
        print(f"Generated text: {output.outputs[0].text!r}")
    outputs = llm.chat([conversation] * 3, sampling_params, use_tqdm=False, chat_template=chat_template)
    print(f"Batch of {len(outputs)} conversations, identical replies: "
          f"{len({o.outputs[0].text for o in outputs}) == 1}")


if __name__ == "__main__":
    main()
