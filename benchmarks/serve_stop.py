"""Start, first request and stop of ``pagedllm serve``: seconds until ``/health`` answers 200, for one
``/v1/completions`` request (5 tokens), and from SIGTERM to the server process's exit.

Usage: python benchmarks/serve_stop.py MODEL [SERVE ARGS...]   (e.g. a tiny checkpoint folder,
``-tp 2``, ``--engine-in-process``). docs/performance.md, "Session 15".
"""
import signal
import socket
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    port = _free_port()
    start = time.monotonic()
    server = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *sys.argv[1:],
                               "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while True:
        if server.poll() is not None:
            sys.exit(f"the server exited with {server.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    ready = time.monotonic()
    httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hello", "max_tokens": 5},
               timeout=60).raise_for_status()
    answered = time.monotonic()
    server.send_signal(signal.SIGTERM)
    code = server.wait()
    stopped = time.monotonic()
    print(f"ready {ready - start:.2f} s, request {answered - ready:.2f} s, stop {stopped - answered:.2f} s "
          f"(exit status {code}): serve {' '.join(sys.argv[1:])}")


if __name__ == "__main__":
    main()
