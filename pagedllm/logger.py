"""vLLM's ``vllm.logger.init_logger`` (its examples and plugins import it): a standard library logger."""

from __future__ import annotations

import logging


def init_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)``; pagedllm configures no handlers of its own on it."""
    return logging.getLogger(name)
