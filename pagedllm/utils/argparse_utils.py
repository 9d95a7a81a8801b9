"""``FlexibleArgumentParser``: vLLM's argument parser (``vllm.utils.argparse_utils``), whose long
flags may be spelled with underscores (``--max_model_len``) as well as dashes."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


def _dashed(arg: str) -> str:
    """``--flag_name[=value]`` -> ``--flag-name[=value]``; anything else unchanged (values,
    short flags, a lone ``--``)."""
    if not arg.startswith("--") or arg == "--":
        return arg
    name, sep, value = arg.partition("=")
    return name.replace("_", "-") + sep + value


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` that reads ``--flag_name`` as ``--flag-name``.

    Only option names are rewritten (the part of ``--name=value`` before ``=``); arguments after
    a lone ``--`` and every value are passed through as given. Errors are argparse's (exit 2).
    """

    def parse_known_args(self, args: Sequence[str] | None = None, namespace=None):
        if args is None:
            args = sys.argv[1:]
        args = list(args)
        end = args.index("--") if "--" in args else len(args)
        args = [_dashed(a) for a in args[:end]] + args[end:]
        return super().parse_known_args(args, namespace)

    def check_port(self, value) -> int:
        """An argparse ``type`` for a server port (vLLM's): an integer in [1024, 65535].

        Raises:
            argparse.ArgumentTypeError: otherwise (argparse reports it and exits with status 2).
        """
        try:
            port = int(value)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"port must be an integer, got {value!r}") from None
        if not 1024 <= port <= 65535:
            raise argparse.ArgumentTypeError(f"port must be in [1024, 65535], got {port}")
        return port
