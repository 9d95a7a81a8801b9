"""Run a command and report its wall time and the peak of the summed RSS of it and all its
descendants (e.g. pytest plus the server subprocesses the tests start), sampled every 0.2 s.

    python tools/peak_memory.py -- python -m pytest -q -m "not slow"

One process's ``time -v`` maximum misses the children a test suite starts; the cgroup's
``memory.peak`` needs a cgroup of one's own. Summed RSS counts pages shared between processes
(mapped libraries) once per process, so it is an upper bound of what the command needs; the summed
PSS (each shared page split between the processes mapping it, from /proc/PID/smaps_rollup) is what
the tree really holds, and is reported beside it. Prints one line to stderr at the end and exits
with the command's status.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import psutil

SAMPLE_INTERVAL_S = 0.2


def tree_memory(root: psutil.Process) -> list[tuple[int, int, str]]:
    """(RSS in bytes, PSS in bytes, command line) of ``root`` and each of its descendants now."""
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    out = []
    for proc in procs:
        try:
            full = proc.memory_full_info()
            out.append((full.rss, full.pss, " ".join(proc.cmdline())[:100]))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=SAMPLE_INTERVAL_S, help="seconds between samples")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    ns = parser.parse_args(argv)
    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not command:
        parser.error("no command given")
    start = time.monotonic()
    proc = subprocess.Popen(command)
    root = psutil.Process(proc.pid)
    peak, peak_procs, peak_at = 0, [], 0.0
    peak_pss, peak_pss_at = 0, 0.0
    while proc.poll() is None:
        procs = tree_memory(root)
        rss = sum(r for r, _, _ in procs)
        pss = sum(p for _, p, _ in procs)
        if rss > peak:
            peak, peak_procs, peak_at = rss, procs, time.monotonic() - start
        if pss > peak_pss:
            peak_pss, peak_pss_at = pss, time.monotonic() - start
        time.sleep(ns.interval)
    wall = time.monotonic() - start
    print(f"peak_memory: exit {proc.returncode}, wall {wall:.1f} s, peak summed RSS {peak / 2**30:.2f} GiB "
          f"({len(peak_procs)} processes, at {peak_at:.0f} s); peak summed PSS {peak_pss / 2**30:.2f} GiB "
          f"(at {peak_pss_at:.0f} s)", file=sys.stderr)
    for rss, pss, cmd in sorted(peak_procs, reverse=True):
        print(f"  {rss / 2**30:6.2f} GiB RSS  {pss / 2**30:6.2f} GiB PSS  {cmd}", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
