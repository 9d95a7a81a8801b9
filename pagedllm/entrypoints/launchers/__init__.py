"""vLLM's ``vllm.entrypoints.launchers`` import path (``launcher.serve_http``)."""
