"""The engine-core process's environment (``engine.dp_client.engine_process_env``): a spawned child
sees ``GOMP_SPINCOUNT=10000`` (its OpenMP threads spin briefly between parallel regions, then sleep
instead of taking the API server's time slices), nothing is added when the user chose a wait
policy, and the parent's environment is as before afterwards."""

from __future__ import annotations

import os
import subprocess
import sys

from pagedllm.engine.dp_client import ENGINE_PROCESS_ENV, engine_process_env

PRINT = "import os; print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))"


def child_values() -> str:
    """GOMP_SPINCOUNT and OMP_WAIT_POLICY as a child started inside the block sees them (as the
    spawned engine core inherits the environment at ``Process.start``)."""
    with engine_process_env():
        out = subprocess.run([sys.executable, "-c", PRINT], capture_output=True, text=True, timeout=60,
                             check=True)
    return out.stdout.strip()


def test_spawned_engine_process_gets_a_short_openmp_spin(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert ENGINE_PROCESS_ENV == {"GOMP_SPINCOUNT": "10000"}
    assert child_values() == "10000 None"
    assert "GOMP_SPINCOUNT" not in os.environ          # the parent's environment is restored


def test_a_wait_policy_the_user_chose_is_kept(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert child_values() == "None ACTIVE"              # no spin count over the user's policy
    environ = {"GOMP_SPINCOUNT": "500"}
    with engine_process_env(environ):
        assert environ == {"GOMP_SPINCOUNT": "500"}
    plain: dict[str, str] = {}
    with engine_process_env(plain):
        assert plain == {"GOMP_SPINCOUNT": "10000"}
    assert plain == {}
