"""The CPU structured-output path never imports triton, with either backend (xgrammar's metadata
requires it, but only its CUDA kernels import it):
a fresh interpreter whose import system refuses every ``triton`` import builds an engine (torch's
own ``has_triton_package`` probe tries once and copes), then records the attempts while it runs
constrained generations: none."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.structured_output.backends import BACKENDS

SCRIPT = r"""
import importlib.abc, json, sys

attempts = []
recording = False

class RefuseTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            if recording:
                attempts.append(name)
            raise ImportError("triton is refused in this test")
        return None

sys.meta_path.insert(0, RefuseTriton())
from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

llm = LLM(sys.argv[1], max_model_len=256, kv_cache_memory_bytes=16 << 20, seed=0, block_size=4,
          structured_outputs_backend=sys.argv[2])
llm.generate(["warm"], SamplingParams(max_tokens=2), use_tqdm=False)
recording = True
schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}
out = llm.generate(["x", "y"], [SamplingParams(max_tokens=40, temperature=1.0, seed=1,
                                               structured_outputs=StructuredOutputsParams(json=schema)),
                                SamplingParams(max_tokens=5, temperature=1.0, seed=2,
                                               structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))],
                   use_tqdm=False)
print(json.dumps({"attempts": attempts, "texts": [o.outputs[0].text for o in out]}))
"""


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.timeout(600)
def test_constrained_generation_imports_no_triton(make_tiny_checkpoint, backend):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, make_tiny_checkpoint("llama"), backend], capture_output=True,
                          text=True, env=env, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["attempts"] == [], result
    assert 0 <= json.loads(result["texts"][0])["a"] <= 9 and result["texts"][1] in ("yes", "no")
