"""Test helper for the C++ extensions built at run time (``platforms/cpu_extension.py``)."""

from __future__ import annotations

import shutil

import pytest


def require_built_extension(load, what: str):
    """The compiled C++ extension ``load()`` returns. Skips (naming the reason) only where no C++
    compiler is on PATH; where one is, a failed build fails the test instead of hiding behind a
    skip (the engine would silently run its torch fallback)."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip(f"no C++ compiler on PATH: {what} cannot be built")
    module = load()
    assert module is not None, f"a C++ compiler is on PATH but {what} did not build (see the warning)"
    return module
