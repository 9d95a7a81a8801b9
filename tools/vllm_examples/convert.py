"""vLLM examples -> pagedllm (issue 28): usage from the trial folder: python convert.py REL_PATH...
with paths relative to vllm-0.33.0/examples; writes run/REL_PATH with the vllm imports renamed and
the models named in MODELS replaced by "default". Nothing else changes."""
import re, sys, pathlib
src = pathlib.Path("vllm-0.33.0/examples")
MODELS = ["facebook/opt-125m","meta-llama/Llama-3.2-1B-Instruct","lmsys/longchat-13b-16k","Qwen/Qwen3-0.6B",
 "ibm-research/PowerMoE-3b","Qwen/Qwen2.5-3B-Instruct","microsoft/Phi-mini-MoE-instruct","meta-llama/Llama-3.1-8B",
 "Qwen/Qwen2.5-7B-Instruct-1M","Qwen/Qwen3-8B","mistralai/Mistral-7B-Instruct-v0.3","Qwen/Qwen2.5-1.5B-Instruct"]
for rel in sys.argv[1:]:
    text = (src/rel).read_text()
    out = []
    for line in text.splitlines(keepends=True):
        if re.match(r"\s*(from|import)\s+vllm\b", line):
            line = re.sub(r"\bvllm\b", "pagedllm", line, count=1)
        for m in MODELS:
            line = line.replace(f'"{m}"', '"default"')
        out.append(line)
    dst = pathlib.Path("run")/rel
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text("".join(out))
