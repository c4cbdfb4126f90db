"""First contact (issue #18 item 6): thread choice, the GGUF hint, exporters' transformers_version, the Python
API's numerics equal to the CLI's."""

from __future__ import annotations

import os

import pytest

from kiln.optimizer import cli


@pytest.fixture
def machine(monkeypatch):
    """A machine of `cpus` logical CPUs on `cores` physical cores under load `load`, OMP_NUM_THREADS unset."""

    def make(cpus: int, cores: int, load: float):
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
        monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load), raising=False)
        monkeypatch.setattr(cli, "physical_cores", lambda allowed: cores)

    return make


@pytest.mark.parametrize("cpus, cores, load, threads, busy", [
    (2, 2, 0.1, 2, False),   # idle: every core
    (2, 2, 2.0, 1, True),    # README command 1 on a busy 2-core machine: 60 s with two threads, 5 s with one
    (16, 8, 0.0, 8, False),  # hyperthreads: one thread per physical core
    (16, 8, 12.0, 4, True),  # others hold 12 of 16 CPUs
    (4, 4, 30.0, 1, True),   # never below one
])
def test_threads_follow_cores_affinity_and_load(machine, cpus, cores, load, threads, busy):
    machine(cpus, cores, load)
    count, why = cli.choose_threads()
    assert count == threads
    assert ("busy" in why) == busy and f"{cpus} CPUs available" in why


def test_omp_num_threads_wins(machine, monkeypatch):
    machine(2, 2, 9.0)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cli.choose_threads() == (2, "OMP_NUM_THREADS")


def test_physical_cores_reads_cpuinfo():
    count = cli.physical_cores()
    if count is None:
        pytest.skip("no /proc/cpuinfo topology here")
    assert 1 <= count <= (os.cpu_count() or count)
