"""How many CPU threads a command computes with: chosen before torch starts its thread pool.

    count, why = use_threads()      # sets OMP_NUM_THREADS (unless the user did) and says why
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def physical_cores(cpus: set[int] | None = None) -> int | None:
    """Distinct physical cores among `cpus` (logical CPU numbers; None: all), from /proc/cpuinfo's physical id and
    core id; None where it does not say (not Linux, or a VM that hides the topology)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    cores = set()
    for block in text.split("\n\n"):
        fields = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        if "processor" not in fields or "core id" not in fields:
            continue
        if cpus is None or int(fields["processor"]) in cpus:
            cores.add((fields.get("physical id", "0"), fields["core id"]))
    return len(cores) or None


def choose_threads() -> tuple[int, str]:
    """CPU threads for torch's (and MKL's, OpenBLAS's) parallel regions, and why.

    OMP_NUM_THREADS set: that, as the user asked. Otherwise the CPUs this process may run on (its affinity mask:
    a container's or taskset's limit), at most one per physical core (a second hyperthread adds nothing to
    GEMMs and costs a barrier), less the load other processes already put on them (the 1-minute load
    average): OpenMP threads wait for each other at every parallel region, so on cores that others are
    busy on, each region waits for the slowest, descheduled thread. README command 1 on a 2-core machine that
    other jobs kept busy took 60 s to gate with two threads and 5 s with one. The numbers do not depend on the
    choice (pin_cpu_numerics: the same weights on one and two threads)."""
    given = os.environ.get("OMP_NUM_THREADS", "").strip()
    if given:
        return (int(given) if given.isdigit() and int(given) > 0 else 1), "OMP_NUM_THREADS"
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        allowed = set(range(os.cpu_count() or 1))
    physical = physical_cores(allowed) or len(allowed)
    top = max(1, min(physical, len(allowed)))
    why = f"{len(allowed)} CPUs available, {physical} physical cores"
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return top, why
    free = int(len(allowed) - load + 0.5)
    if free < top:
        return max(1, free), f"{why}, load average {load:.1f}: busy"
    return top, f"{why}, load average {load:.1f}"


THREADS: tuple[int, str] | None = None
"""What use_threads chose for this process (the build's log line says it)."""


def use_threads() -> tuple[int, str]:
    """choose_threads, applied: OMP_NUM_THREADS for torch, MKL and OpenBLAS not yet started, and torch's own
    count when torch is imported already (an in-process caller)."""
    global THREADS
    count, why = choose_threads()
    os.environ.setdefault("OMP_NUM_THREADS", str(count))
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(count)
    THREADS = count, why
    return THREADS



def chosen_threads() -> tuple[int, str]:
    """What use_threads chose for this process, choosing now if nothing has yet (an in-process caller)."""
    return THREADS or use_threads()
