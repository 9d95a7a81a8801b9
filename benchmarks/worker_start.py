"""Start time of a multi-rank engine: workers from the fork server (the default) vs spawned.

Usage: python benchmarks/worker_start.py MODEL_FOLDER forkserver|spawn TP
Builds three engines one after another in one process and prints each one's start time (seconds)."""
import sys
import time


def main():
    import pagedllm.executor.multiproc as multiproc
    from pagedllm import LLM, SamplingParams
    multiproc.WORKER_START_METHOD = sys.argv[2]
    tp = int(sys.argv[3])
    for i in range(3):
        t1 = time.time()
        llm = LLM(sys.argv[1], dtype="float32", tensor_parallel_size=tp, max_model_len=128,
                  kv_cache_memory_bytes=4 << 20, cpu_threads_per_rank=1)
        t2 = time.time()
        llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        llm.llm_engine.shutdown()
        del llm
        print(f"{sys.argv[2]} tp{tp} engine {i}: start {t2 - t1:.2f} s", flush=True)


if __name__ == "__main__":
    main()
