"""vLLM's online "structured_outputs" example: a running ``pagedllm serve`` queried with the openai
client: guided choice, regex, a JSON schema through ``response_format`` and a pydantic ``parse``."""

import argparse
import json

from openai import OpenAI
from pydantic import BaseModel, Field


class People(BaseModel):
    # Bounds keep a small base model's greedy reply short (unbounded, it may write digits until max_tokens).
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)


def main(port: int):
    client = OpenAI(base_url=f"http://localhost:{port}/v1", api_key="EMPTY")
    model = client.models.list().data[0].id
    choice = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Classify this sentiment: vLLM is wonderful!"}],
        extra_body={"structured_outputs": {"choice": ["positive", "negative"]}}, max_tokens=8, temperature=0)
    print("choice:", choice.choices[0].message.content)
    regex = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Generate an example email address for Alan Turing, "
                                "who works in Enigma. End in .com and new line."}],
        extra_body={"structured_outputs": {"regex": r"[a-z.]{1,20}@[a-z]{1,10}\.com\n"}}, max_tokens=48, temperature=0)
    print("regex:", json.dumps(regex.choices[0].message.content))
    schema = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Generate a JSON with the name and age of one person"}],
        response_format={"type": "json_schema", "json_schema": {"name": "people", "schema": People.model_json_schema()}},
        max_tokens=60, temperature=0)
    print("json:", schema.choices[0].message.content)
    parsed = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "A person as JSON"}], response_format=People,
        max_tokens=60, temperature=0)
    print("parsed:", repr(parsed.choices[0].message.parsed))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8000)
    main(parser.parse_args().port)
