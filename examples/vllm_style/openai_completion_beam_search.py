"""vLLM's online beam search: ``use_beam_search`` through the completions route, ``n`` = beam width."""

import argparse

from openai import OpenAI


def main(port: int):
    client = OpenAI(base_url=f"http://localhost:{port}/v1", api_key="EMPTY")
    model = client.models.list().data[0].id
    completion = client.completions.create(model=model, prompt="The capital of France is", n=3, max_tokens=8,
                                           extra_body={"use_beam_search": True})
    for choice in completion.choices:
        print(f"beam {choice.index}: {choice.text!r}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8000)
    main(parser.parse_args().port)
