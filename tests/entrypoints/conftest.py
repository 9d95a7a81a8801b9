"""Helpers for the server tests: start the real server as a subprocess on a free loopback port."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """``python -m <module> <args> --host 127.0.0.1 --port <free>`` in a subprocess.

    Args:
        args: server arguments (model, flags).
        log_path: where the server's stdout/stderr go (shown when startup fails).
        module: ``pagedllm.entrypoints.openai.api_server`` or ``pagedllm.entrypoints.cli`` (then
            ``args`` starts with ``serve``).
        startup_timeout: seconds to wait for ``/health``.
        env: extra environment variables.
        start_new_session: the server leads a process group of its own (its children join it),
            as under a shell, so a test can signal the whole group.
    """

    def __init__(self, args: list[str], log_path: Path, module: str = "pagedllm.entrypoints.openai.api_server",
                 startup_timeout: float = 300.0, env: dict[str, str] | None = None,
                 start_new_session: bool = False) -> None:
        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        self.log_path = log_path
        self._log = open(log_path, "w")
        cmd = [sys.executable, "-m", module, *args, "--host", "127.0.0.1", "--port", str(self.port),
               "--disable-uvicorn-access-log"]
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=start_new_session)
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.terminate()
                raise RuntimeError(f"server did not become healthy in {startup_timeout} s:\n{self.log_tail()}")
            time.sleep(0.1)

    def log_tail(self, n: int = 60) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def client(self, api_key: str = "EMPTY", **kwargs):
        import openai
        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=300.0, **kwargs)

    def async_client(self, api_key: str = "EMPTY", **kwargs):
        import openai
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=300.0, **kwargs)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {'name{labels}': value}, plus {'name': value} for single-series names."""
        import httpx
        text = httpx.get(self.url + "/metrics", timeout=30.0).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
            values.setdefault(key.split("{", 1)[0], float(value))
        return values

    def metric(self, name: str, **labels: str) -> float:
        for key, value in self.metrics().items():
            if key.split("{", 1)[0] != name:
                continue
            if all(re.search(rf'{k}="{re.escape(v)}"', key) for k, v in labels.items()):
                return value
        raise KeyError(f"{name} {labels} not in /metrics")

    def terminate(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def launch_server(tmp_path_factory):
    """Factory: (args, name, **kwargs) -> a started ``RemoteServer``; all are stopped at the end of the
    test module, so that at most one module's server processes (each loading a model) are alive."""
    servers: list[RemoteServer] = []

    def launch(args: list[str], name: str = "server", **kwargs) -> RemoteServer:
        log = tmp_path_factory.mktemp(name) / "server.log"
        server = RemoteServer(args, log, **kwargs)
        servers.append(server)
        return server

    yield launch
    for server in servers:
        server.terminate()


@pytest.fixture
def asgi_run():
    """``run(state, coro_fn)``: call ``await coro_fn(client)`` with an httpx client wired to the app
    of ``state`` in this process (no server, no port), and return its result."""
    import asyncio

    import httpx

    from pagedllm.entrypoints.openai.api_server import build_app

    def run(state, coro_fn):
        async def main():
            transport = httpx.ASGITransport(app=build_app(state))
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
                return await coro_fn(client)
        return asyncio.run(main())

    return run


@pytest.fixture(scope="module")
def long_checkpoint(make_tiny_checkpoint, tmp_path_factory):
    """The tiny Llama with a 4096-token context (a folder path): JSON-mode prompts and the tools
    template put schemas in the prompt."""
    folder = tmp_path_factory.mktemp("tiny_llama_long")
    shutil.copytree(make_tiny_checkpoint("llama"), folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    return str(folder)
