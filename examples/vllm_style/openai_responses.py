"""vLLM's online Responses API example: ``client.responses.create``, a follow-up turn through
``previous_response_id``, and a streamed response."""

import argparse

from openai import OpenAI


def main(port: int):
    client = OpenAI(base_url=f"http://localhost:{port}/v1", api_key="EMPTY")
    model = client.models.list().data[0].id
    first = client.responses.create(model=model, input="Tell me a three-sentence bedtime story about a unicorn.",
                                    max_output_tokens=24, temperature=0)
    print("first:", first.id, first.status, repr(first.output_text))
    follow_up = client.responses.create(model=model, input="Now give the unicorn a name.",
                                        previous_response_id=first.id, max_output_tokens=16, temperature=0)
    print("follow_up:", follow_up.id, follow_up.status, repr(follow_up.output_text),
          "input_tokens", follow_up.usage.input_tokens, ">", first.usage.input_tokens)
    text = ""
    events = []
    for event in client.responses.create(model=model, input="Count to five:", max_output_tokens=12,
                                         temperature=0, stream=True):
        events.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
    print("stream:", events[0], events[-1], repr(text))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8000)
    main(parser.parse_args().port)
