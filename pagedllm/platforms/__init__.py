"""What the machine the engine runs on can do (vLLM's ``platforms``): the CPU's instruction sets."""
