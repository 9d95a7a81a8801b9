"""Start, first request and stop of ``pagedllm serve``: seconds until ``/health`` answers 200, for one
``/v1/completions`` request (5 tokens), and from SIGTERM to the server process's exit.

Usage: python benchmarks/serve_stop.py MODEL [SERVE ARGS...]   (e.g. a tiny checkpoint folder,
``-tp 2``, ``--engine-in-process``). docs/performance.md, "Session 15".
"""
import signal
import sys
import time

import httpx
from serve_start import kill_server, start_server


def main():
    server, port, ready_s = start_server(sys.argv[1:], poll_s=0.05)
    try:
        answered = time.monotonic()
        httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hello", "max_tokens": 5},
                   timeout=60).raise_for_status()
        request_s = time.monotonic() - answered
    except BaseException:
        kill_server(server)
        raise
    stop = time.monotonic()
    server.send_signal(signal.SIGTERM)
    code = server.wait()
    print(f"ready {ready_s:.2f} s, request {request_s:.2f} s, stop {time.monotonic() - stop:.2f} s "
          f"(exit status {code}): serve {' '.join(sys.argv[1:])}")


if __name__ == "__main__":
    main()
