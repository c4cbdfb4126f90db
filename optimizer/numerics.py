"""CPU numerics pinned before torch starts: the same bytes from `optimize build` and from `kiln.optimizer.build`.

MKL reads MKL_CBWR and OpenBLAS reads OPENBLAS_CORETYPE once, when each initializes, so the variables must be set
before torch (or numpy) is imported. The CLI pins them first thing in `main`; `import kiln.optimizer` (which
any `from kiln.optimizer.build import build` runs first) pins them too, so the Python API computes as the CLI
does. A process that imported torch or numpy before Kiln may have started its BLAS unpinned: importing
kiln.optimizer then warns (`pin_for_python`).
"""

from __future__ import annotations

import os
import platform
import sys
import warnings
from pathlib import Path

CPU_NUMERICS = {
    "MKL_CBWR": "AVX2,STRICT",  # MKL's GEMMs: its strict reproducible mode, the same bits for any number of threads
    # OpenBLAS (scipy's: GPTQ's factorization; numpy's too): its AVX2 kernels on every x86-64 CPU seen to have
    # AVX2 (pin_cpu_numerics). Left to pick by CPU it runs
    # SkylakeX kernels on AVX-512 parts and Haswell/Zen ones elsewhere, whose factors differ in the last bits
    # (the Zen and Haswell ones agree); on this project's AVX-512 EPYC the AVX2 ones cost about 5% at K = 8192
    "OPENBLAS_CORETYPE": "Haswell",
}
"""What a command pins before torch computes anything (see pin_cpu_numerics). Not ATEN_CPU_CAPABILITY=avx2: with
it, torch.compile's CPU decode step (Inductor) returned wrong tokens on an AVX-512 machine
(tests/runtime/test_compiled_decode.py)."""


def pin_cpu_numerics() -> None:
    """MKL's AVX2 branch in its strict reproducible mode and OpenBLAS's AVX2 kernels (CPU_NUMERICS), so that a CPU
    build's figures do not depend on the thread count or on which x86 CPU runs OpenBLAS (how the auto
    recipe's figures moved: benchmarks/results/tuning.md). With MKL's pin and one-thread tuning
    (calibration.tuning) the two-thread check in tests/optimizer/test_cli.py holds. Two more causes sat
    outside MKL: torch's CPU silu and sigmoid (runtime.activations.silu computes them thread-invariantly) and
    GPTQ's factorization in
    OpenBLAS (calibration.gptq.one_blas_thread); with both mended, the AWQ recipes (fp8-weights, fp8) store the
    same tensors on one and two threads too. Across machines: OpenBLAS now runs the same kernels on any x86-64
    with AVX2, but MKL honours its AVX2 branch on Intel CPUs only and runs its AUTO branch on AMD's, so
    machines may still differ (not measured). A variable the user set wins; the manifest records what ran
    (build's `numerics`). On an AMD EPYC with AVX-512 it costs nothing measurable (SmolLM2-sized GEMMs); on
    Intel's AVX-512 parts MKL's AVX2 GEMMs may be slower (not measured)."""
    seen = has_avx2(confirmed=True)  # /proc/cpuinfo read once where it exists
    if not seen and not has_avx2():
        return  # another architecture (an ARM Grace host) or an x86 without AVX2: its own code paths, unpinned
    for name, value in CPU_NUMERICS.items():
        if name == "OPENBLAS_CORETYPE" and not seen:
            continue  # OpenBLAS does not check a forced core type: Haswell kernels need AVX2 seen, not assumed
        os.environ.setdefault(name, value)


def has_avx2(confirmed: bool = False) -> bool:
    """An x86-64 CPU with AVX2 (Linux: /proc/cpuinfo's flags; elsewhere: any x86-64, which torch then checks,
    unless `confirmed`: then only what /proc/cpuinfo shows)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        return " avx2" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return not confirmed


_UNPINNED_AT_IMPORT: list[tuple[list[str], list[str]]] = []
"""(variables pinned, modules imported before them) when kiln.optimizer was imported after torch or numpy."""


def pin_for_python() -> None:
    """pin_cpu_numerics for a Python caller (kiln.optimizer's import). When torch or numpy was imported before
    with other settings their BLAS may already run unpinned, and a build's bytes may then differ from the CLI's:
    remembered here, and said when a build starts (warn_if_unpinned), not at import, where most importers (lm-eval,
    a script that only loads an artifact) build nothing."""
    unset = [name for name in CPU_NUMERICS if name not in os.environ]
    pin_cpu_numerics()
    pinned = [name for name in unset if name in os.environ]
    early = [name for name in ("torch", "numpy") if name in sys.modules]
    if pinned and early:
        _UNPINNED_AT_IMPORT.append((pinned, early))


def warn_if_unpinned() -> None:
    """A Python build whose process imported torch or numpy before kiln.optimizer: say once that its bytes may
    differ from `optimize build`'s, and how to avoid it."""
    if not _UNPINNED_AT_IMPORT:
        return
    pinned, early = _UNPINNED_AT_IMPORT.pop()
    warnings.warn(f"{' and '.join(early)} {'were' if len(early) > 1 else 'was'} imported before kiln.optimizer, so "
                  f"{', '.join(pinned)} (the CLI's CPU numerics, kiln.optimizer.numerics) may not apply to it: this "
                  "build may store other bytes than `optimize build` does. Import kiln.optimizer first, or set "
                  + ", ".join(f"{n}={CPU_NUMERICS[n]}" for n in pinned) + " in the environment.",
                  RuntimeWarning, stacklevel=3)
