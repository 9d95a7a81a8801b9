"""The ``pagedllm`` command: ``generate`` (offline batch), ``serve`` (OpenAI server), ``bench``."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time

from pagedllm.utils.process_exit import exit_process

logger = logging.getLogger("pagedllm")


def _read_prompts(ns) -> list:
    """Prompts from arguments, a text file (one per line) or a JSONL file ({"prompt": ...} or
    {"prompt_token_ids": [...]}, optional per-line "max_tokens").

    Raises:
        ValueError: if no prompt is given, the file does not exist, or a JSONL line is malformed
            (names the line).
    """
    prompts: list = list(ns.prompts or [])
    if ns.prompts_file:
        path = ns.prompts_file
        if not os.path.isfile(path):
            raise ValueError(f"--prompts-file {path!r}: no such file")
        with open(path, encoding="utf-8") as f:
            if path.endswith((".jsonl", ".json")):
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{lineno}: not JSON ({e})") from e
                    if isinstance(obj, str):
                        obj = {"prompt": obj}
                    if not isinstance(obj, dict) or not ({"prompt", "prompt_token_ids"} & set(obj)):
                        raise ValueError(f"{path}:{lineno}: needs a 'prompt' or 'prompt_token_ids' field")
                    prompts.append(obj)
            else:
                prompts.extend(line.rstrip("\n") for line in f if line.strip())
    if not prompts:
        raise ValueError("no prompts: pass them as arguments or with --prompts-file")
    return prompts


def _cmd_generate(ns) -> int:
    if ns.owns_process:
        # The ~10^6 objects these imports (torch's) make live as long as the process: no
        # collection during the imports, and none walks them again later (docs/performance.md,
        # start-up).
        gc.disable()
    from pagedllm.engine.arg_utils import engine_args_from_cli
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    if ns.owns_process:
        gc.freeze()
        gc.enable()
    prompts = _read_prompts(ns)
    args = engine_args_from_cli(ns)
    base = dict(n=ns.n, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, min_p=ns.min_p,
                seed=ns.sampling_seed, max_tokens=ns.max_tokens, stop=ns.stop or None, ignore_eos=ns.ignore_eos,
                repetition_penalty=ns.repetition_penalty, logprobs=ns.logprobs)
    params, engine_prompts = [], []
    for p in prompts:
        kw = dict(base)
        if isinstance(p, dict):
            if "max_tokens" in p:
                kw["max_tokens"] = int(p["max_tokens"])
            p = {k: v for k, v in p.items() if k in ("prompt", "prompt_token_ids")}
        params.append(SamplingParams(**kw))
        engine_prompts.append(p)
    t0 = time.perf_counter()
    llm = LLM(**{k: v for k, v in vars(args).items()})
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    outputs = llm.generate(engine_prompts, params, use_tqdm=not ns.no_progress)
    elapsed = time.perf_counter() - t1
    out = open(ns.output_file, "w", encoding="utf-8") if ns.output_file else sys.stdout
    try:
        for i, ro in enumerate(outputs):
            if ns.output_format == "jsonl":
                out.write(json.dumps({
                    "index": i, "prompt": ro.prompt, "prompt_token_ids": ro.prompt_token_ids,
                    "outputs": [{"index": o.index, "text": o.text, "token_ids": o.token_ids,
                                 "cumulative_logprob": o.cumulative_logprob, "finish_reason": o.finish_reason,
                                 "stop_reason": o.stop_reason} for o in ro.outputs]}, ensure_ascii=False) + "\n")
            else:
                for o in ro.outputs:
                    label = f"{i}" if len(ro.outputs) == 1 else f"{i}.{o.index}"  # [i.j]: sample j of n
                    out.write(f"--- [{label}] finish_reason={o.finish_reason}\n")
                    out.write(f"{ro.prompt if ro.prompt is not None else ro.prompt_token_ids}"
                              f"\033[1m{o.text}\033[0m\n" if out.isatty() else
                              f"{ro.prompt if ro.prompt is not None else ro.prompt_token_ids}{o.text}\n")
    finally:
        if out is not sys.stdout:
            out.close()
    n_prompt = sum(len(ro.prompt_token_ids) for ro in outputs)
    n_out = sum(len(o.token_ids) for ro in outputs for o in ro.outputs)
    print(f"Throughput: {len(outputs) / elapsed:.2f} requests/s, {n_out / elapsed:.1f} output tokens/s, "
          f"{(n_prompt + n_out) / elapsed:.1f} total tokens/s ({len(outputs)} requests, {n_prompt} prompt + "
          f"{n_out} output tokens in {elapsed:.2f} s; engine load {load_s:.2f} s)", file=sys.stderr)
    if ns.owns_process:
        # Stop the engine here, then spare the interpreter's exit its collections over every
        # object (~0.3 s): what is left is freed by reference counts or with the process.
        llm.llm_engine.shutdown()
        gc.freeze()
    return 0


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Make ``--help`` give each option's default, in ``parser`` and every subcommand's parser
    (added anywhere), as ``argparse.ArgumentDefaultsHelpFormatter`` does, and also for options
    without a help text. Left out: options whose help already speaks of a default, ``None``
    defaults (nothing to show) and on/off flags."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _show_defaults(sub)
            continue
        text = action.help or ""
        if (not action.option_strings or text is argparse.SUPPRESS or "default" in text
                or action.default is None or action.default is argparse.SUPPRESS or isinstance(action.default, bool)):
            continue
        action.help = f"{text} (default: %(default)s)" if text else "default: %(default)s"


def _subcommand(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names ("generate", "serve", "bench"), or None (``--help``, a typo)."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--log-level":
            i += 2
            continue
        if arg.startswith("--log-level="):
            i += 1
            continue
        return arg if arg in ("generate", "serve", "bench") else None
    return None


def build_parser(subcommand: str | None = None) -> argparse.ArgumentParser:
    """The ``pagedllm`` parser; with ``subcommand``, only that subcommand's parser is built (the
    others would import what this run does not use), else all of them."""
    from pagedllm.engine.arg_utils import add_engine_cli_args

    parser = argparse.ArgumentParser(prog="pagedllm", description="Paged-KV-cache LLM inference engine")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="offline batch generation")
    gen.add_argument("prompts", nargs="*", help="prompts (or use --prompts-file)")
    gen.add_argument("--prompts-file", help="text file (one prompt per line) or JSONL ({'prompt': ...})")
    gen.add_argument("--output-file", help="write results here instead of stdout")
    gen.add_argument("--output-format", choices=["text", "jsonl"], default="text")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--logprobs", type=int, default=None)
    gen.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_engine_cli_args(gen)
    gen.set_defaults(func=_cmd_generate)

    # The server's parser imports the FastAPI app (over a second): only built when it can be used.
    if subcommand in (None, "serve"):
        try:
            from pagedllm.entrypoints.openai.cli_serve import add_serve_parser
            add_serve_parser(sub)
        except ImportError:
            pass
    if subcommand in (None, "bench"):
        try:
            from pagedllm.benchmarks.cli import add_bench_parser
            add_bench_parser(sub)
        except ImportError:
            pass
    _show_defaults(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; returns the exit status (2 for a ``ValueError``, printed as one line).

    Args:
        argv: the arguments; None means ``sys.argv[1:]``: this process is the ``pagedllm``
            command (the console script, ``python -m``) and ends after it, so ``generate`` may
            leave the objects alive at its end to the process's exit (``gc.freeze``), and the
            process ends in here with the status (``utils.process_exit.exit_process``: no
            interpreter finalization). A caller's ``main([...])`` (tests) keeps the collector as
            it was and gets the status back.
    """
    owns_process = argv is None
    if argv is None:
        argv = sys.argv[1:]
    parser = build_parser(_subcommand(argv))
    ns = parser.parse_args(argv)
    ns.owns_process = owns_process
    logging.basicConfig(level=getattr(logging, str(ns.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        code = int(ns.func(ns) or 0)
    except ValueError as e:
        print(f"pagedllm: error: {e}", file=sys.stderr)
        code = 2
    if owns_process:   # the command ends here: skip the interpreter's finalization (utils/process_exit.py)
        exit_process(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
