"""C kernels for the CPU path, compiled on first use with the system C compiler.

``cpu_decode.c`` (paged decode attention) is built with ``cc`` into a shared library and
called through ctypes, which releases the GIL for the call. The library is cached under
``$PDSERVE_CACHE_DIR/kernels``, else ``$XDG_CACHE_HOME/pdserve/kernels``, else
``~/.cache/pdserve/kernels``, named by a hash of the source, the compiler and its flags, and
this CPU's model and feature flags: a cache copied to another machine never loads a build
for the wrong instruction set. Builds go to a temporary file renamed into place, so several
processes building at once are safe.

The kernel runs in float32 or bfloat16 (bf16 query/cache/output, float32 arithmetic).
``cpu_bf16_native()`` says whether this CPU has bf16 instructions (``avx512_bf16`` or
``amx_bf16``); the kernel's bf16 path does not need them (it widens bf16 with shifts), but
``dtype="auto"`` only picks bf16 where they exist (docs/design.md §3, docs/engine.md).

``PDSERVE_CPU_KERNELS=0`` turns the kernels off (the torch path runs instead, for A/B
comparisons). Without a working compiler one warning is logged and the torch path runs.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ENV_SWITCH = "PDSERVE_CPU_KERNELS"
# Element dtypes the kernel takes (query, cache and output share one), with its dtype code.
KERNEL_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# /proc/cpuinfo flags of CPUs with bf16 arithmetic (AVX-512 BF16 dot products, AMX tiles).
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
SOURCE = Path(__file__).with_name("cpu_decode.c")
# -march=native: this machine's vector width (the cache key includes the CPU, so the build
# never runs elsewhere). -fopenmp-simd: only the vectorization pragmas, no OpenMP runtime
# (torch already loads its own; a second one in the process fights it for the cores).
CFLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=gnu11", "-shared", "-fPIC", "-pthread")

_ERRORS = {
    1: "seq_lens[{i}] must be in [1, table_width * block_size]",
    2: "block_tables[{i}] holds a block id outside [0, num_blocks)",
    3: "reqs[{i}] is outside [0, num_reqs)",
    4: "q_rows[{i}] is outside [0, query tokens)",
    5: "out of memory for the attention scratch buffers",
}


def kernels_enabled() -> bool:
    """False when ``PDSERVE_CPU_KERNELS`` is 0/false/off/no."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def cpu_bf16_native(cpuinfo: str | None = None) -> bool:
    """True when this CPU (or the given ``/proc/cpuinfo`` text) lists ``avx512_bf16`` or
    ``amx_bf16``. False where /proc/cpuinfo cannot be read (not Linux): unknown means no."""
    if cpuinfo is None:
        return _this_cpu_bf16_native()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() == "flags" and BF16_CPU_FLAGS & set(value.split()):
            return True
    return False


@functools.cache
def _this_cpu_bf16_native() -> bool:
    try:
        return cpu_bf16_native(Path("/proc/cpuinfo").read_text())
    except OSError:
        return False


# SmolLM2-135M greedy agreement of bf16 with float32: mean fraction of leading tokens (of
# 32) identical over 12 prompts, measured by tests/integration/test_cpu_bf16_agreement.py
# (2026-12-01: 0.747; 5 of 12 outputs identical, the first token of all 12; docs/engine.md
# "CPU bfloat16"). ``dtype="auto"`` picks bf16 only on native-bf16 CPUs and only while
# this is at least BF16_AUTO_MIN_AGREEMENT, so today auto is float32 on every CPU.
BF16_GREEDY_AGREEMENT = 0.75
BF16_AUTO_MIN_AGREEMENT = 0.9


def leading_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean over pairs of the fraction of leading tokens two greedy outputs share (greedy
    outputs diverge for good after the first difference, so later matches do not count)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"need two equally long, non-empty lists, got {len(a)} and {len(b)}")
    fracs = []
    for x, y in zip(a, b, strict=True):
        same = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        fracs.append(same / max(len(x), len(y), 1))
    return sum(fracs) / len(fracs)


def auto_cpu_dtype(cpuinfo: str | None = None) -> str:
    """What ``dtype="auto"`` means on the CPU: "bfloat16" on CPUs with native bf16
    (``cpu_bf16_native``) when bf16's measured greedy agreement with float32 is high
    enough, else "float32". Without native bf16, bf16 matmuls are emulated and the
    accuracy cost buys less; docs/engine.md gives the numbers."""
    if cpu_bf16_native(cpuinfo) and BF16_GREEDY_AGREEMENT >= BF16_AUTO_MIN_AGREEMENT:
        return "bfloat16"
    return "float32"


def cache_dir() -> Path:
    if os.environ.get("PDSERVE_CACHE_DIR"):
        return Path(os.environ["PDSERVE_CACHE_DIR"]).expanduser() / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "pdserve" / "kernels"


def _cpu_identity() -> str:
    """CPU model and feature flags (what -march=native compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    keep = ("model name", "flags", "features", "cpu model", "isa")
    lines = {ln.strip() for ln in text.splitlines() if ln.split(":")[0].strip().lower() in keep}
    return f"{platform.machine()}\n" + "\n".join(sorted(lines))


def _build_key(compiler: list[str], source: bytes) -> str:
    version = subprocess.run(
        [*compiler, "--version"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    h = hashlib.sha256()
    for part in (source, " ".join(CFLAGS).encode(), version.encode(), _cpu_identity().encode()):
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:24]


def build_library(directory: Path | None = None) -> Path:
    """Compile ``cpu_decode.c`` (or reuse the cached build) and return the library's path.
    Raises RuntimeError when no compiler is found or the compile fails."""
    try:
        compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or ""]
    except ValueError as exc:  # e.g. unbalanced quotes: a bad setting, not a crash
        raise RuntimeError(f"cannot parse $CC {os.environ.get('CC')!r}: {exc}") from None
    if not compiler[0]:
        raise RuntimeError("no C compiler ('cc') on PATH")
    source = SOURCE.read_bytes()
    directory = directory or cache_dir()
    target = directory / f"cpu_decode-{_build_key(compiler, source)}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".cpu_decode-", suffix=".so", dir=directory)
    os.close(fd)
    try:
        proc = subprocess.run(
            [*compiler, *CFLAGS, str(SOURCE), "-o", tmp],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{shlex.join(compiler)} failed: {proc.stderr.strip()[-2000:]}")
        # Atomic on POSIX: another process either sees no file or the finished one.
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class DecodeKernel:
    """ctypes front end of ``pd_paged_decode``: validates every argument (a bad one is a
    ValueError, never a crash) and runs the kernel on ``torch.get_num_threads()`` threads."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        fn = lib.pd_paged_decode
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [p, i64, i64, p, i64, i64, i64, i64, p, i64, i64, p, p, p, i64]
        fn.argtypes += [ctypes.c_float, p, i64, i64, ctypes.POINTER(i64)]
        fn.restype = ctypes.c_int
        self._fn = fn
        self._lib = lib  # keeps the library loaded as long as the kernel lives
        self.path = path
        # None: torch.get_num_threads() at each call.
        self.num_threads: int | None = None

    def __call__(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        reqs: torch.Tensor | None = None,
        q_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode attention into ``out`` [T, Hq, D] and return it.

        ``query``, ``kv_cache`` and ``out`` are all float32 or all bfloat16 (bf16 is
        computed in float32 and rounded to nearest-even once, at the output). ``query`` [T, Hq, D]; ``kv_cache`` [2, num_blocks, block_size, Hkv, D];
        ``block_tables`` [num_reqs, width] int32; ``seq_lens`` [num_reqs] int32. Item i
        attends query row ``q_rows[i]`` over request ``reqs[i]``'s first ``seq_lens``
        tokens (int64 index tensors of equal length; None = 0..num_reqs-1 for both). Rows of
        ``out`` that no item names are left as they were."""
        _check_float(query, "query", 3)
        _check_float(kv_cache, "kv_cache", 5)
        _check_float(out, "out", 3)
        if not query.dtype == kv_cache.dtype == out.dtype:
            raise ValueError(
                "query, kv_cache and out must share one dtype, got "
                f"{query.dtype}, {kv_cache.dtype} and {out.dtype}"
            )
        tokens, q_heads, dim = query.shape
        two, num_blocks, block_size, kv_heads, kv_dim = kv_cache.shape
        if dim < 1:
            # The kernel's vector loops read 16 floats per step from the rows: with an empty
            # head there is no row to read (a 0-sized cache is a null pointer).
            raise ValueError(f"query head dim must be >= 1, got {list(query.shape)}")
        if two != 2 or kv_dim != dim or num_blocks < 1 or block_size < 1 or kv_heads < 1:
            raise ValueError(
                f"kv_cache must be [2, num_blocks, block_size, kv_heads, {dim}], "
                f"got {list(kv_cache.shape)}"
            )
        if q_heads % kv_heads:
            raise ValueError(f"query heads ({q_heads}) must be a multiple of kv heads ({kv_heads})")
        if out.shape != query.shape:
            raise ValueError(
                f"out must have query's shape {list(query.shape)}, got {list(out.shape)}"
            )
        _check_int(block_tables, "block_tables", 2, torch.int32)
        _check_int(seq_lens, "seq_lens", 1, torch.int32)
        num_reqs, width = block_tables.shape
        if seq_lens.shape[0] != num_reqs:
            raise ValueError(
                f"seq_lens has {seq_lens.shape[0]} entries, block_tables {num_reqs} rows"
            )
        if (reqs is None) != (q_rows is None):
            raise ValueError("reqs and q_rows must be given together")
        n = num_reqs
        if reqs is not None and q_rows is not None:
            _check_int(reqs, "reqs", 1, torch.int64)
            _check_int(q_rows, "q_rows", 1, torch.int64)
            if reqs.shape != q_rows.shape:
                raise ValueError(f"reqs {list(reqs.shape)} and q_rows {list(q_rows.shape)} differ")
            n = reqs.shape[0]
        elif tokens < num_reqs:
            raise ValueError(f"query has {tokens} rows, fewer than the {num_reqs} requests")
        if n == 0:
            return out
        bad = ctypes.c_int64(-1)
        threads = self.num_threads or torch.get_num_threads()
        # Named in profiles: a ctypes call is otherwise invisible to torch.profiler.
        with torch.profiler.record_function("pd_paged_decode"):
            code = self._fn(
                query.data_ptr(), tokens, q_heads,
                kv_cache.data_ptr(), num_blocks, block_size, kv_heads, dim,
                block_tables.data_ptr(), num_reqs, width, seq_lens.data_ptr(),
                None if reqs is None else reqs.data_ptr(),
                None if q_rows is None else q_rows.data_ptr(),
                n, scale, out.data_ptr(), threads, KERNEL_DTYPES[query.dtype], ctypes.byref(bad),
            )  # fmt: skip
        if code:
            if code == 5:
                raise MemoryError(_ERRORS[code])
            raise ValueError(_ERRORS.get(code, f"kernel error {code}").format(i=bad.value))
        return out


def _check_float(t: torch.Tensor, name: str, ndim: int) -> None:
    if t.device.type != "cpu" or t.dtype not in KERNEL_DTYPES:
        raise ValueError(
            f"{name} must be a CPU float32 or bfloat16 tensor, got {t.dtype} on {t.device}"
        )
    if t.dim() != ndim or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {ndim}-D tensor, got {list(t.shape)}")


def _check_int(t: torch.Tensor, name: str, ndim: int, dtype: torch.dtype) -> None:
    if t.device.type != "cpu" or t.dtype != dtype or t.dim() != ndim or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous {ndim}-D CPU {dtype} tensor, "
            f"got {t.dtype} {list(t.shape)} on {t.device}"
        )


# functools.cache alone lets concurrent first calls each run the (seconds-long) build.
_LOAD_LOCK = threading.Lock()


def load_decode_kernel() -> DecodeKernel | None:
    """The process's decode kernel, built on first call; None (after one warning) when the
    build fails. Cached: a process compiles and warns at most once, also when several
    threads make the first call at once."""
    with _LOAD_LOCK:
        return _load_decode_kernel()


@functools.cache
def _load_decode_kernel() -> DecodeKernel | None:
    try:
        return DecodeKernel(build_library())
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        logger.warning(
            "CPU attention kernel unavailable (%s); using the torch path. Install a C "
            "compiler (cc) for faster CPU decoding, or set %s=0 to silence this.",
            exc,
            ENV_SWITCH,
        )
        return None
