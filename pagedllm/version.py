"""The package version (one place; ``pagedllm.__version__``, ``GET /version`` and the FastAPI app read it)."""

__version__ = "0.1.0"
