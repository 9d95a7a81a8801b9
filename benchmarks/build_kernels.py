"""Build every C++ kernel of the project from scratch, one after another, and print each one's time.

Usage: TORCH_EXTENSIONS_DIR=EMPTY_FOLDER /usr/bin/time -f "%e s, peak %M KB" python benchmarks/build_kernels.py [LABEL ...]
An empty ``TORCH_EXTENSIONS_DIR`` makes each load a build (``platforms.cpu_extension``); ``/usr/bin/time``'s
peak RSS is then the largest compiler process's. docs/benchmarks.md, "Building the C++ kernels"."""
import logging
import sys
import time


def main():
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from pagedllm.platforms.cpu_extension import load_extension
    from pagedllm.worker.kernel_builds import KERNELS
    extensions = [entry.extension() for entry in KERNELS]
    for ext in extensions:
        if sys.argv[1:] and ext.label not in sys.argv[1:]:
            continue
        t = time.perf_counter()
        built = load_extension(ext) is not None
        print(f"{ext.label}: {'built' if built else 'FAILED'} in {time.perf_counter() - t:.1f} s", flush=True)


if __name__ == "__main__":
    main()
