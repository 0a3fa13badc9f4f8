"""Run a command under CPU kernels other than the ones this environment selects by default.

Usage: python .ci/other_kernels.py COMMAND [ARGS...]   (``make test-kernels`` runs pytest so)

A test that pins the rounding of one kernel (a BLAS dot product, a vectorized log) passes on
the machine it was written on and fails on the next CPU. Running the noise and structured
linear-algebra tests a second time with every kernel library switched to another code path
catches that here (docs/design.md, "What is reproducible, and where"):

* OpenBLAS (numpy, scipy): ``OPENBLAS_CORETYPE`` -- Haswell, or Sandybridge when the first
  pass already runs Haswell kernels (ARMV8 / NEOVERSEN1 on ARM);
* ATen (torch's vectorized CPU ops): ``ATEN_CPU_CAPABILITY`` -- default (no SIMD), or avx2 when
  the first pass is already at default;
* MKL (torch's BLAS on x86): ``MKL_ENABLE_INSTRUCTIONS`` -- SSE4_2, or AVX2 when already SSE4_2;
* numpy's dispatched SIMD loops (log, cos, sin, ... of the seed noise):
  ``NPY_DISABLE_CPU_FEATURES`` -- every dispatched feature off (the baseline loops), or all back
  on when the first pass already disabled some.

The selection used is printed first. Values already in the environment are the first pass's,
so each variable is set to something else.
"""

from __future__ import annotations

import os
import platform
import sys


def _openblas_core() -> str:
    """The OpenBLAS core numpy runs on now (OPENBLAS_CORETYPE already applied), '' if unknown."""
    try:
        import numpy  # noqa: F401  (threadpoolctl sees only loaded libraries)
        from threadpoolctl import threadpool_info
    except ImportError:
        return os.environ.get("OPENBLAS_CORETYPE", "")
    for lib in threadpool_info():
        if lib.get("internal_api") == "openblas" and lib.get("architecture"):
            return str(lib["architecture"])
    return os.environ.get("OPENBLAS_CORETYPE", "")


def _aten_capability() -> str:
    try:
        import torch

        return str(torch.backends.cpu.get_cpu_capability())
    except (ImportError, AttributeError):
        return os.environ.get("ATEN_CPU_CAPABILITY", "")


def _numpy_dispatch() -> list[str]:
    try:
        from numpy._core._multiarray_umath import __cpu_dispatch__
    except ImportError:  # numpy < 2
        from numpy.core._multiarray_umath import __cpu_dispatch__
    return list(__cpu_dispatch__)


def other_kernels() -> dict[str, str]:
    """Environment variables that select kernels other than the current ones."""
    arm = platform.machine().lower() in ("aarch64", "arm64")
    core = _openblas_core().lower()
    if arm:
        openblas = "NEOVERSEN1" if core == "armv8" else "ARMV8"
    else:
        openblas = "Sandybridge" if core == "haswell" else "Haswell"
    aten = "avx2" if _aten_capability().lower() == "default" and not arm else "default"
    mkl = "AVX2" if os.environ.get("MKL_ENABLE_INSTRUCTIONS", "").upper() == "SSE4_2" else "SSE4_2"
    npy = "" if os.environ.get("NPY_DISABLE_CPU_FEATURES", "").strip() else ",".join(_numpy_dispatch())
    return {"OPENBLAS_CORETYPE": openblas, "ATEN_CPU_CAPABILITY": aten, "MKL_ENABLE_INSTRUCTIONS": mkl,
            "NPY_DISABLE_CPU_FEATURES": npy}


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    chosen = other_kernels()
    print("other kernels: " + " ".join(f"{k}={v}" for k, v in chosen.items()), flush=True)
    os.execvpe(argv[0], argv, {**os.environ, **chosen})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
