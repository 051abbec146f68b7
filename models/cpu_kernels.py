"""Builds and loads the CPU kernels written in C (`cpu_attention`, `cpu_gemm`): compiled
with the system C compiler on first use, cached under $ASERVE_CACHE_DIR (default
~/.cache/aserve) by a hash of the source, flags, compiler and CPU, loaded through ctypes.

Each kernel is optional: `build` returns None without a compiler, when compiling fails, or
when ASERVE_CPU_KERNELS=0, and the caller keeps its torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-pthread")


def _cache_dir() -> Path:
    return Path(os.environ.get("ASERVE_CACHE_DIR") or Path.home() / ".cache" / "aserve")


def _cpu_flags() -> str:
    """This CPU's feature flags (Linux), or "" where /proc/cpuinfo is missing."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))),
                "")


def build(name: str, source: str, argtypes: list[Any] | None = None) -> ctypes.CDLL | None:
    """The shared library compiled from `source` (C), named `name_<hash>.so` in the cache,
    its function `name` declared with `argtypes` and an int result; None when kernels are
    off, no compiler exists or compiling fails (logged)."""
    if os.environ.get("ASERVE_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("no C compiler: %s uses its torch path", name)
        return None
    # NOTE: -march=native code may not run on another CPU sharing this cache (a network home):
    # the key names this CPU's instruction sets.
    key = "\n".join((source, " ".join(FLAGS), compiler, platform.machine(), _cpu_flags()))
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    path = _cache_dir() / f"{name}_{digest}.so"
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                src, built = Path(tmp) / f"{name}.c", Path(tmp) / path.name
                src.write_text(source)
                subprocess.run([compiler, *FLAGS, str(src), "-o", str(built), "-lm"],
                               check=True, capture_output=True, timeout=120)
                built.replace(path)  # atomic: concurrent processes see a whole library
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("CPU kernel %s not built (%s): using its torch path", name, exc)
        return None
    function = getattr(lib, name)
    function.argtypes, function.restype = argtypes, ctypes.c_int
    return lib
