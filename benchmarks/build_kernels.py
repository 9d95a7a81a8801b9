"""Build every C++ kernel of the project from scratch, one after another, and print each one's time.

Usage: TORCH_EXTENSIONS_DIR=EMPTY_FOLDER /usr/bin/time -f "%e s, peak %M KB" python benchmarks/build_kernels.py [LABEL ...]
An empty ``TORCH_EXTENSIONS_DIR`` makes each load a build (``platforms.cpu_extension``); ``/usr/bin/time``'s
peak RSS is then the largest compiler process's. docs/benchmarks.md, "Building the C++ kernels"."""
import logging
import sys
import time


def main():
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from pagedllm.attention.backends import cpu_paged
    from pagedllm.layers import amx_gemm, bf16_gemm, f32_gemm, f32_moe, fused_ops, int8_gemm
    from pagedllm.lora import punica
    from pagedllm.platforms.cpu_extension import load_extension
    extensions = [cpu_paged.EXTENSION, punica.EXTENSION, f32_moe.EXTENSION, bf16_gemm.EXTENSION,
                  bf16_gemm.AVX2_EXTENSION, f32_gemm.EXTENSION, int8_gemm.EXTENSION, fused_ops.EXTENSION,
                  amx_gemm.EXTENSION]
    for ext in extensions:
        if sys.argv[1:] and ext.label not in sys.argv[1:]:
            continue
        t = time.perf_counter()
        built = load_extension(ext) is not None
        print(f"{ext.label}: {'built' if built else 'FAILED'} in {time.perf_counter() - t:.1f} s", flush=True)


if __name__ == "__main__":
    main()
