"""The engine-core process's environment (``engine.dp_client.engine_process_env``): a spawned child
sees ``OMP_WAIT_POLICY=PASSIVE`` (its OpenMP threads sleep between parallel regions instead of
taking the API server's time slices), a value the user set is kept, and the parent's environment
is as before afterwards."""

from __future__ import annotations

import os
import subprocess
import sys

from pagedllm.engine.dp_client import ENGINE_PROCESS_ENV, engine_process_env


def child_value() -> str | None:
    """OMP_WAIT_POLICY as a child started inside the block sees it (as the spawned engine core
    inherits the environment at ``Process.start``)."""
    with engine_process_env():
        out = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('OMP_WAIT_POLICY'))"],
                             capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


def test_spawned_engine_process_gets_passive_openmp(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert ENGINE_PROCESS_ENV == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert child_value() == "PASSIVE"
    assert "OMP_WAIT_POLICY" not in os.environ          # the parent's environment is restored


def test_a_value_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    environ = {"OMP_WAIT_POLICY": "ACTIVE"}
    with engine_process_env(environ):
        assert environ == {"OMP_WAIT_POLICY": "ACTIVE"}
    assert child_value() == "ACTIVE"
    plain: dict[str, str] = {}
    with engine_process_env(plain):
        assert plain == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert plain == {}
