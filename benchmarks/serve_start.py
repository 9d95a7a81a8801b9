"""Start cost of ``pagedllm serve``: seconds until ``/health`` answers 200, and each process's CPU
time (user + system, seconds), resident memory (MiB) and whether it loaded torch.

Usage: python benchmarks/serve_start.py [SERVE ARGS...]   (e.g. nothing: the default model;
``--engine-in-process``; ``MODEL_FOLDER -tp 2``). Starts the server on a free loopback port, polls
``/health`` every 0.2 s, reads the process tree with psutil, then stops the server.
"""
import socket
import subprocess
import sys
import time

import httpx
import psutil


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(serve_args: list[str], poll_s: float = 0.2) -> tuple[subprocess.Popen, int, float]:
    """Start ``pagedllm serve <serve_args>`` on a free loopback port and wait until ``/health``
    answers 200 (polled every ``poll_s`` seconds). Returns (process, port, seconds to ready).
    Exits this script if the server exits first."""
    port = _free_port()
    start = time.monotonic()
    server = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *serve_args,
                               "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if server.poll() is not None:
                sys.exit(f"the server exited with {server.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                    return server, port, time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(poll_s)
    except BaseException:   # Ctrl-C or an error while waiting: leave no server behind
        kill_server(server)
        raise


def kill_server(server: subprocess.Popen) -> None:
    """SIGKILL the server and reap it (an error or Ctrl-C while it runs)."""
    server.kill()
    server.wait(60)


def main():
    server, _, ready_s = start_server(sys.argv[1:])
    try:
        root = psutil.Process(server.pid)
        total = 0.0
        for proc in [root, *root.children(recursive=True)]:
            cpu = proc.cpu_times()
            torch_loaded = any("libtorch_cpu" in m.path for m in proc.memory_maps())
            total += cpu.user + cpu.system
            print(f"pid {proc.pid}: {cpu.user + cpu.system:6.2f} s CPU, {proc.memory_info().rss / 2**20:6.0f} MiB RSS, "
                  f"torch {'loaded' if torch_loaded else 'not loaded'}: {' '.join(proc.cmdline())[-60:]}")
        print(f"ready in {ready_s:.1f} s; {total:.1f} s of CPU over the process tree")
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
