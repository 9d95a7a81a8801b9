"""vLLM's online "tool calls with tool_choice required" example: the reply is a list of calls of the
given tools (the grammar makes any model comply), then a named function."""

import argparse
import json

from openai import OpenAI

tools = [{
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "Get the current weather in a given location",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city to find the weather for", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}]
messages = [{"role": "user", "content": "What is the weather like in Dallas, Texas?"}]


def main(port: int):
    client = OpenAI(base_url=f"http://localhost:{port}/v1", api_key="EMPTY")
    model = client.models.list().data[0].id
    # parallel_tool_calls=False: at most one call (a small base model may otherwise repeat calls).
    required = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice="required",
                                              parallel_tool_calls=False, max_tokens=120, temperature=0)
    for call in required.choices[0].message.tool_calls:
        print("required:", call.function.name, json.loads(call.function.arguments))
    named = client.chat.completions.create(
        model=model, messages=messages, tools=tools, max_tokens=120, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_current_weather"}})
    call = named.choices[0].message.tool_calls[0]
    print("named:", call.function.name, json.loads(call.function.arguments))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8000)
    main(parser.parse_args().port)
