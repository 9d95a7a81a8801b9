"""Two hosts on one machine: two network namespaces joined by a veth pair (10.99.0.1/24 and
10.99.0.2/24, addresses that exist only inside the namespaces), a Ray head in one (``ray start
--head``), a Ray worker in the other (``ray start --address=10.99.0.1:6379``), one CPU each. The
engine process runs in the head's namespace and serves tensor_parallel_size=2 with
``ray_placement_strategy="SPREAD"``: one rank per "host", gloo over the veth
(``GLOO_SOCKET_IFNAME``). Greedy tokens equal a tensor_parallel_size=1 run (float32, logprobs
within 1e-4), and the two ranks report the two different node addresses. Ray's token
authentication is on, with a token made for the run and given to every node (``RAY_AUTH_TOKEN``).

Needs root (``ip netns add``); without it the test skips and says why. Every subprocess has a
timeout; teardown kills every process inside the two namespaces (found with ``ip netns pids``, so
nothing outside them is touched: ``ray stop`` would kill every Ray process on the machine, other
users' too) and deletes the namespaces, which destroys the veth pair; the test then checks that no
process and no namespace is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

ray = pytest.importorskip("ray", reason="Ray is in the [ray] and [dev] extras; pip install -e '.[dev]'")

from pagedllm.engine.llm_engine import LLMEngine  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import ray_two_hosts_driver as driver  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(driver.__file__).resolve()
SUFFIX = str(os.getpid())
NS_HEAD, NS_WORKER = f"pl_head_{SUFFIX}", f"pl_wrk_{SUFFIX}"
VETH_HEAD, VETH_WORKER = "veth_head", "veth_wrk"   # created inside the namespaces, never in ours
HEAD_IP, WORKER_IP = "10.99.0.1", "10.99.0.2"
GCS_PORT = 6379
RAY_AUTH_TOKEN = secrets.token_hex(32)   # this run's cluster token, given to every node and the driver
RAY_STARTED = "This command will now block forever"   # what `ray start --block` prints once the node is up
# Seconds: each `ip` call, each `ray start`, the engine process, one round of waiting for processes to exit.
IP_TIMEOUT_S, RAY_START_TIMEOUT_S, DRIVER_TIMEOUT_S, KILL_WAIT_S = 30, 120, 300, 10


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _namespaces_unavailable() -> str | None:
    """Why this process cannot build network namespaces, or None if it can."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"pl_probe_{SUFFIX}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed (network namespaces need root / CAP_SYS_ADMIN): {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _namespaces() -> set[str]:
    return {line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()}


def _netns_pids(ns: str) -> list[int]:
    return [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]


def _kill_namespace_processes(ns: str, seen: set[tuple[int, float]]) -> None:
    """SIGTERM every process in ``ns``, wait, SIGKILL the rest; repeat until none is left.

    ``seen`` collects (pid, start time) of each process found, for the test's final check.
    Raises:
        RuntimeError: if processes are still there after three rounds.
    """
    for sig in (signal.SIGTERM, signal.SIGKILL, signal.SIGKILL):
        procs = []
        for pid in _netns_pids(ns):
            try:
                proc = psutil.Process(pid)
                seen.add((pid, proc.create_time()))
                proc.send_signal(sig)
                procs.append(proc)
            except psutil.NoSuchProcess:
                pass
        if not procs:
            return
        psutil.wait_procs(procs, timeout=KILL_WAIT_S)
    left = _netns_pids(ns)
    if left:
        raise RuntimeError(f"processes {left} are still running in namespace {ns}")


@contextlib.contextmanager
def two_hosts(seen: set[tuple[int, float]]):
    """Two namespaces joined by a veth pair, each with its address and loopback up.

    Yields when the link is up; on exit (also on error) kills every process in the namespaces and
    deletes them (the veth pair goes with them).
    """
    created = []
    try:
        for ns in (NS_HEAD, NS_WORKER):
            _ip("netns", "add", ns)
            created.append(ns)
        _ip("link", "add", VETH_HEAD, "netns", NS_HEAD, "type", "veth", "peer", "name", VETH_WORKER,
            "netns", NS_WORKER)
        for ns, dev, addr in ((NS_HEAD, VETH_HEAD, HEAD_IP), (NS_WORKER, VETH_WORKER, WORKER_IP)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield
    finally:
        errors = []
        for ns in created:
            try:
                _kill_namespace_processes(ns, seen)
            except Exception as e:   # still delete the namespaces; report after
                errors.append(e)
        for ns in created:
            _ip("netns", "del", ns, check=False)
        if errors:
            raise errors[0]


def _env(veth: str) -> dict[str, str]:
    """This process's environment with the worktree importable, gloo on ``veth``, Ray quiet, and
    Ray's token authentication on with this run's token (Ray turns it on for a head node when
    ``~/.ray/auth_token`` exists, but not for a worker node: every node must be told the same)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
    return {**env, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
            "GLOO_SOCKET_IFNAME": veth, "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": RAY_AUTH_TOKEN}


def _in_ns(ns: str, *command: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", "netns", "exec", ns, *command], env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])}... in {ns} failed ({proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def _ray_start(ns: str, veth: str, temp_dir: str, *args: str) -> subprocess.Popen:
    """``ray start --block`` (one CPU, a small object store, its own temp folder) inside ``ns``, once
    the node is up. ``--block`` keeps ``ray start`` as the parent of the node's processes, so they stay
    descendants of this one (for tools/peak_memory.py) rather than daemons.

    Raises:
        RuntimeError: if ``ray start`` exits or has not started the node within ``RAY_START_TIMEOUT_S``.
    """
    os.makedirs(temp_dir)
    log_path = os.path.join(temp_dir, "ray_start.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "ray.scripts.scripts", "start",
                                 "--block", "--num-cpus", "1", "--num-gpus", "0", "--disable-usage-stats",
                                 "--object-store-memory", str(100 << 20), "--temp-dir", temp_dir, *args],
                                env=_env(veth), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + RAY_START_TIMEOUT_S
    while RAY_STARTED not in Path(log_path).read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"ray start in {ns} did not start the node (exit {proc.poll()}):\n"
                               f"{Path(log_path).read_text()[-6000:]}")
        time.sleep(0.5)
    return proc


# Two Ray nodes, two actors, one engine process: 2.5 GiB summed RSS, too much beside the parallel
# tier's other worker, so the serial tier (docs/distributed.md).
@pytest.mark.slow
@pytest.mark.timeout(2 * RAY_START_TIMEOUT_S + DRIVER_TIMEOUT_S + 120)
def test_tp2_across_two_namespaced_hosts_equals_tp1(make_tiny_checkpoint):
    reason = _namespaces_unavailable()
    if reason is not None:
        pytest.skip(f"two-host Ray test needs network namespaces: {reason}")
    folder = make_tiny_checkpoint("llama")   # 4 query heads, 2 KV heads: one each per rank
    single = LLMEngine(driver.engine_args(folder))
    want = driver.run(single)
    single.shutdown()

    seen: set[tuple[int, float]] = set()
    # Short folders: Ray's unix sockets live under them (at most ~107 bytes of path).
    temp_root = tempfile.mkdtemp(prefix="pl2h", dir="/tmp")
    ray_starts: list[subprocess.Popen] = []
    try:
        with two_hosts(seen):
            ray_starts.append(_ray_start(NS_HEAD, VETH_HEAD, f"{temp_root}/h", "--head", f"--port={GCS_PORT}",
                                         f"--node-ip-address={HEAD_IP}", "--include-dashboard", "false"))
            ray_starts.append(_ray_start(NS_WORKER, VETH_WORKER, f"{temp_root}/w",
                                         f"--address={HEAD_IP}:{GCS_PORT}", f"--node-ip-address={WORKER_IP}"))
            env = {**_env(VETH_HEAD), "RAY_ADDRESS": f"{HEAD_IP}:{GCS_PORT}"}
            proc = _in_ns(NS_HEAD, sys.executable, str(DRIVER), folder, env=env, timeout=DRIVER_TIMEOUT_S)
            got = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        for start in ray_starts:   # killed with their namespace; reaped here
            start.wait(timeout=KILL_WAIT_S)
        shutil.rmtree(temp_root, ignore_errors=True)

    # Nothing is left behind: no namespace, no process that ran in them, no veth in our namespace.
    assert not {NS_HEAD, NS_WORKER} & _namespaces()
    assert seen, "teardown found no Ray process in the namespaces"
    for pid, created in seen:
        with contextlib.suppress(psutil.NoSuchProcess):
            assert psutil.Process(pid).create_time() != created, f"process {pid} survived the teardown"
    host_links = _ip("-o", "link").stdout
    assert VETH_HEAD not in host_links and VETH_WORKER not in host_links

    # One rank per host: rank 0 on the head, rank 1 on the worker, two different Ray nodes.
    assert got["strategy"] == "SPREAD"
    assert got["cluster_nodes"] == [HEAD_IP, WORKER_IP]
    assert sorted(got["rank_node_ips"]) == [HEAD_IP, WORKER_IP]
    assert len(set(got["rank_node_ids"])) == 2
    # The same greedy tokens as tensor_parallel_size=1, logprobs to float32 rounding.
    assert got["outputs"].keys() == want.keys()
    for rid, (tokens, logprobs) in want.items():
        assert got["outputs"][rid][0] == tokens, rid
        for g, w in zip(got["outputs"][rid][1], logprobs, strict=True):
            assert g.keys() == w.keys(), rid
            assert all(abs(g[t] - w[t]) < 1e-4 for t in w), rid
