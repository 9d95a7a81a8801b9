"""``pagedllm serve [MODEL] [flags]``: the OpenAI-compatible server (see ``api_server``)."""

from __future__ import annotations


def _cmd_serve(ns) -> int:
    from pagedllm.entrypoints.openai.api_server import run_server

    return run_server(ns)


def add_serve_parser(subparsers) -> None:
    """Add the ``serve`` subcommand (every engine flag plus the server's, with vLLM's names)."""
    from pagedllm.entrypoints.openai.api_server import make_arg_parser

    serve = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server",
        description="Serve a model over the OpenAI API: /v1/completions, /v1/chat/completions, /v1/models, "
                    "/health, /version, /tokenize, /detokenize, /metrics.")
    make_arg_parser(serve)
    serve.set_defaults(func=_cmd_serve)
