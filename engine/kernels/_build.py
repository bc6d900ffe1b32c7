"""Build the CUDA kernels at first use (nvcc, sm_90a) and load them with ctypes.

The CUDA file includes no torch headers and exports plain C functions, so it builds in seconds
with nvcc alone and does not depend on torch's C++ ABI; the result is cached under
``$QERL_CACHE_DIR/kernels`` (or ``~/.cache/qerl/kernels``) by a hash of the source (with the
local headers it includes), the flags and the compiler's version. Importing this module needs
neither a compiler nor a GPU.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("nvfp4_gemm.cu")
FLAGS = ["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-lineinfo", "-shared", "-Xcompiler", "-fPIC"]

_P = ctypes.c_void_p
_I = ctypes.c_int
_SIGNATURES = {
    "qerl_nvfp4_gemm_small": [_I, _I, _I, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I, _I,
                              _P, _P, _P, _I, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _I, ctypes.c_float, _P],
    "qerl_nvfp4_gemm_wg": [_I, _I, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I, _P, _I],
    "qerl_nvfp4_occupancy": [_I, _I],
    "qerl_nvfp4_occupancy_wg": [_I, _I],
    "qerl_nvfp4_wg_permuted_rows": [],
    "qerl_nvfp4_ws_stage_bytes": [ctypes.c_int],
    "qerl_nvfp4_dequant": [_P, _P, _I, _I, _I, _I, _P],
    "qerl_nvfp4_error_string": [_I],
}


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


def _cache_dir() -> Path:
    root = os.environ.get("QERL_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "qerl"
    return base / "kernels"


def _with_headers(source: Path, seen: set[Path] | None = None) -> str:
    """The source's text followed by that of the local headers it includes (``#include "..."``),
    so that editing a header rebuilds every kernel file that uses it."""
    seen = set() if seen is None else seen
    seen.add(source.resolve())
    text = source.read_text()
    parts = [text]
    for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', text, flags=re.MULTILINE):
        header = (source.parent / name).resolve()
        if header not in seen:
            parts.append(_with_headers(header, seen))
    return "\n".join(parts)


def compile_cached(source: Path, stem: str, flags: list[str], what: str) -> Path:
    """``nvcc flags source`` into a shared library cached by a hash of the source (with its local
    headers), the flags and the compiler's version (``$QERL_CACHE_DIR/kernels/{stem}_{hash}.so``);
    written atomically."""
    nvcc = _nvcc()
    if nvcc is None:
        raise RuntimeError(f"nvcc not found: install the CUDA toolkit or set CUDA_HOME to build the {what}")
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256((_with_headers(source) + " ".join(flags) + version).encode()).hexdigest()[:16]
    out_dir = _cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{stem}_{digest}.so"
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        cmd = [nvcc, *flags, "-o", tmp, str(source)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"building the {what} failed:\n{' '.join(cmd)}\n{res.stderr[-4000:]}")
        log.debug("built %s", target)
        os.replace(tmp, target)  # atomic: concurrent builders agree on the file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load_library(source: Path, stem: str, flags: list[str], what: str, signatures: dict[str, list],
                 error_string: str, fallback: str) -> ctypes.CDLL | None:
    """``source`` built (``compile_cached``) and loaded, each exported function's argument types
    set from ``signatures`` (``error_string`` returns a C string, the others an int error code);
    None, with one warning naming ``fallback``, when it cannot be built or loaded here."""
    try:
        lib = ctypes.CDLL(str(compile_cached(source, stem, flags, what)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("%s unavailable, using %s: %s", what, fallback, exc)
        return None
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_char_p if name == error_string else ctypes.c_int
    return lib


def library_from(source: Path, stem: str = "qerl_nvfp4", what: str = "NVFP4 CUDA kernels",
                 fallback: str = "the torch reference") -> ctypes.CDLL | None:
    """The NVFP4 kernels built from ``source`` (this package's nvfp4_gemm.cu or another version of
    it, its headers beside it) and loaded, or None (with one warning) when they cannot be."""
    return load_library(source, stem, FLAGS, what, _SIGNATURES, "qerl_nvfp4_error_string", fallback)


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded NVFP4 kernels, or None (with one warning) when they cannot be built here."""
    return library_from(SOURCE)


def check(lib: ctypes.CDLL, err: int, what: str) -> None:
    if err != 0:
        raise RuntimeError(f"{what} failed: CUDA error {err} ({lib.qerl_nvfp4_error_string(err).decode()})")
