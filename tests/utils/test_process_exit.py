"""``exit_process`` ends a process with its status after what the interpreter's exit would do
(threads, pools, atexit handlers, buffered output), skipping only the finalization; the
``pagedllm`` command and an engine process end through it."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_exit_process_keeps_the_status_threads_pools_atexit_and_buffered_output(tmp_path):
    marker = tmp_path / "atexit.txt"
    script = textwrap.dedent(f"""
        import atexit, sys, threading, time
        from concurrent.futures import ThreadPoolExecutor
        from pathlib import Path
        from pagedllm.utils.process_exit import exit_process

        done = []
        def slow(): time.sleep(0.3); done.append("thread")
        threading.Thread(target=slow).start()              # non-daemon: waited for
        pool = ThreadPoolExecutor(1)
        pool.submit(lambda: (time.sleep(0.3), done.append("pool")))   # left running: finished
        atexit.register(lambda: Path({str(marker)!r}).write_text(",".join(sorted(done))))
        sys.stdout.write("no newline, still buffered")
        exit_process(5)
        print("not reached")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 5, proc.stderr
    assert proc.stdout == "no newline, still buffered"
    assert marker.read_text() == "pool,thread"


def test_none_is_status_0_and_a_thread_other_than_main_falls_back_to_sys_exit():
    script = textwrap.dedent("""
        import threading
        from pagedllm.utils.process_exit import exit_process
        caught = []
        def run():
            try:
                exit_process(7)
            except SystemExit as e:
                caught.append(e.code)
        t = threading.Thread(target=run); t.start(); t.join()
        print(caught)
        exit_process(None)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[7]", proc.stderr
