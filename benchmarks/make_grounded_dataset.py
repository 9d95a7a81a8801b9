"""Write ``pagedllm/data/grounded.jsonl``: the input-grounded benchmark set (``--dataset grounded``).

Requests whose outputs quote their prompts, made from this repository's own text: edits of a
paragraph of the docs (the model writes the paragraph again), quotes from a section (the model
quotes its sentences) and code completions of the package's own source (the model continues a
module whose earlier code it has read). These are the requests prompt lookup and suffix decoding
are for (``README``, "Speculative decoding"). Seeded; rerun to regenerate:

    python benchmarks/make_grounded_dataset.py

Each line: ``{"prompt": str, "prompt_len": int, "max_tokens": int, "kind": "edit" | "quote" | "code"}``,
``prompt_len`` counted with the default model's tokenizer.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "pagedllm" / "data" / "grounded.jsonl"
NUM_PER_KIND = 11
MAX_TOKENS = 128
SEED = 0


def paragraphs() -> list[str]:
    """Prose paragraphs of 60-220 words from the docs and README (no tables, code or lists)."""
    out = []
    for path in sorted([REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]):
        for block in re.split(r"\n\s*\n", path.read_text(encoding="utf-8")):
            block = block.strip()
            if not block or block[0] in "#|`-*>0123456789" or "```" in block:
                continue
            words = len(block.split())
            if 60 <= words <= 220:
                out.append(block)
    return out


def code_prefixes(rng: random.Random) -> list[str]:
    """Prefixes of the package's modules, cut at a line that starts a ``def`` after 60+ lines (the 50 lines before it and the def line)."""
    out = []
    files = sorted(p for p in (REPO / "pagedllm").rglob("*.py") if p.stat().st_size > 6000)
    for path in rng.sample(files, min(len(files), 3 * NUM_PER_KIND)):
        lines = path.read_text(encoding="utf-8").splitlines()
        cuts = [i for i, line in enumerate(lines) if i >= 60 and line.lstrip().startswith("def ")]
        if cuts:
            cut = rng.choice(cuts)
            out.append("\n".join(lines[max(0, cut - 50): cut + 1]) + "\n")
    return out


def main() -> None:
    from pagedllm.loaders import resolve_model
    from pagedllm.tokenizer import Tokenizer

    rng = random.Random(SEED)
    tokenizer = Tokenizer.from_pretrained(resolve_model(None).folder)
    paras = paragraphs()
    rows = []
    for text in rng.sample(paras, NUM_PER_KIND):
        rows.append(("edit", f"Original paragraph:\n{text}\n\nThe same paragraph, with its typos fixed:\n"))
    for _ in range(NUM_PER_KIND):
        section = "\n\n".join(rng.sample(paras, 2))
        rows.append(("quote", f"{section}\n\nThe key sentences of the text above, quoted word for word:\n1. \""))
    for prefix in code_prefixes(rng)[:NUM_PER_KIND]:
        rows.append(("code", prefix))
    rng.shuffle(rows)
    with OUT.open("w", encoding="utf-8") as f:
        for kind, prompt in rows:
            f.write(json.dumps({"prompt": prompt, "prompt_len": len(tokenizer.encode(prompt)),
                                "max_tokens": MAX_TOKENS, "kind": kind}) + "\n")
    print(f"wrote {len(rows)} requests to {OUT}")


if __name__ == "__main__":
    main()
