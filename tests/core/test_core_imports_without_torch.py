"""``pagedllm.core`` (and the per-step message it builds) imports without torch: checked in a fresh
interpreter in which importing torch raises."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])  # the checkout holding this pagedllm

_SCRIPT = r'''
import sys

class BlockTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
        return None

sys.meta_path.insert(0, BlockTorch())
import pagedllm.core.scheduler, pagedllm.core.kv_cache_manager, pagedllm.core.sched_output  # noqa: E401
import pagedllm.worker.request_states, pagedllm.config, pagedllm.outputs  # noqa: E401
try:
    import torch  # noqa: F401
except ImportError:
    print("blocked")
assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules), "torch was imported"
print("ok")
'''


def test_core_imports_without_torch():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [ROOT, os.environ.get("PYTHONPATH", "")] if p)}
    result = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["blocked", "ok"]
