"""Print vLLM's own watermark values that ``tests/watermarking/test_vllm_reference.py`` holds.

Needs a vLLM source tree (not an installed vLLM): ``--vllm-src`` points at its ``vllm/`` folder
(default: the unpacked vLLM 0.33.0 sdist at /tmp/vllm_trial/vllm-0.33.0/vllm). Only torch is
needed: the script loads vLLM's ``v1/watermarking/prfs/{base,philox}.py`` and ``detector.py`` as
modules under stub packages, and from ``gumbel.py`` only the function
``_gamma_survival_integer_shape`` (its other imports pull in all of vLLM), then prints

* PhiloxPRF uniforms for a few (key, context, token) triples;
* the Gumbel detector's score, p-value and scored-token count (vLLM's ``GumbelWatermarkDetector``
  is rebuilt from its base class ``WatermarkDetector`` and the scoring its ``gumbel.py`` does:
  ``-log1p(-u)`` per scored token, summed; the Gamma survival function) on fixed token lists.

Usage: python tools/watermarking/vllm_reference_values.py [--vllm-src PATH]
Nothing of vLLM is copied into pagedllm: the values are pasted into the test by hand.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import sys
import types

import torch


def _load(name: str, path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _function_from(path: str, func_name: str, namespace: dict) -> object:
    """One top-level function of a file, compiled alone (the file's imports are not run)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == func_name)
    exec(compile(ast.Module(body=[node], type_ignores=[]), path, "exec"), namespace)
    return namespace[func_name]


def load_vllm(src: str):
    for pkg in ("vllm", "vllm.v1", "vllm.v1.watermarking", "vllm.v1.watermarking.prfs"):
        sys.modules.setdefault(pkg, types.ModuleType(pkg)).__path__ = []
    wm = os.path.join(src, "v1", "watermarking")
    _load("vllm.v1.watermarking.prfs.base", os.path.join(wm, "prfs", "base.py"))
    philox = _load("vllm.v1.watermarking.prfs.philox", os.path.join(wm, "prfs", "philox.py"))
    detector = _load("vllm.v1.watermarking.detector", os.path.join(wm, "detector.py"))
    import math

    survival = _function_from(os.path.join(wm, "gumbel.py"), "_gamma_survival_integer_shape",
                              {"math": math})
    return philox.PhiloxPRF, detector.WatermarkDetector, survival


# The triples and token lists the test holds (keep both in step).
PRF_CASES = [
    (1234, [-1, -1, -1, -1], 0),
    (1234, [-1, -1, -1, -1], 7),
    (1234, [10, 20, 30, 40], 262143),
    (1234, [2, 5, 17, 99], 1001),
    (0, [0, 0, 0, 0], 0),
    (2**64 - 1, [262143, 1, 2, 3], 5),
    (987654321987654321, [5, 6], 12345),              # width 2
    (42, [1, 2, 3, 4, 5, 6, 7], 3),                   # width 7: two blocks
    (42, [100, 200, 300, 400, 500, 600, 700, 800, 900], 31),   # width 9: three blocks
]
DETECT_CASES = [
    (1234, 4, list(range(100, 160))),
    (1234, 4, [5, 6, 7, 8] * 10 + [9, 10, 11]),       # repeated contexts: deduplicated
    (7, 2, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4]),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-src", default="/tmp/vllm_trial/vllm-0.33.0/vllm")
    args = parser.parse_args()
    PhiloxPRF, WatermarkDetector, survival = load_vllm(args.vllm_src)
    print(f"# torch {torch.__version__}; vLLM source {args.vllm_src}")
    print("PRF_UNIFORMS = [  # (key, context, token, uniform)")
    for key, ctx, tok in PRF_CASES:
        u = PhiloxPRF(key).uniform(torch.tensor([ctx]), torch.tensor([[tok]]))
        print(f"    ({key}, {ctx}, {tok}, {float(u.item())!r}),")
    print("]")

    class Detector(WatermarkDetector):   # vLLM's GumbelWatermarkDetector, rebuilt (see above)
        def __init__(self, key, width):
            super().__init__(width, 0.01, True)
            self.prf = PhiloxPRF(key)

        def _score_tokens(self, contexts, targets):
            u = self.prf.uniform(contexts, targets.unsqueeze(-1)).squeeze(-1)
            return -torch.log1p(-u.to(torch.float64))

        def _aggregate_scores(self, token_scores):
            return token_scores.sum().item()

        def _get_p_value(self, score, num_scored_tokens):
            return survival(score, num_scored_tokens)

    print("DETECTIONS = [  # (key, context_width, token_ids, score, p_value, num_scored_tokens)")
    for key, width, ids in DETECT_CASES:
        d = Detector(key, width).detect(ids)
        print(f"    ({key}, {width}, {ids}, {d.score!r}, {d.p_value!r}, {d.num_scored_tokens}),")
    print("]")
    # A vocabulary row, for the sampler's 4-token grouping: key 1234, context (1, 2, 3, 4).
    row = PhiloxPRF(1234).uniform(torch.tensor([[1, 2, 3, 4]]), torch.arange(16))[0]
    print(f"VOCAB_ROW_1234 = {[float(x) for x in row]!r}")


if __name__ == "__main__":
    main()
