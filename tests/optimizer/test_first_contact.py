"""First contact (issue #18 item 6): thread choice, the GGUF hint, exporters' transformers_version, the Python
API's numerics equal to the CLI's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kiln.optimizer.cli import threads as cli_threads
from kiln.optimizer.numerics import has_avx2


@pytest.fixture
def machine(monkeypatch):
    """A machine of `cpus` logical CPUs on `cores` physical cores under load `load`, OMP_NUM_THREADS unset."""

    def make(cpus: int, cores: int, load: float):
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
        monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load), raising=False)
        monkeypatch.setattr(cli_threads, "physical_cores", lambda allowed: cores)

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
    count, why = cli_threads.choose_threads()
    assert count == threads
    assert ("busy" in why) == busy and f"{cpus} CPUs available" in why


def test_omp_num_threads_wins(machine, monkeypatch):
    machine(2, 2, 9.0)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cli_threads.choose_threads() == (2, "OMP_NUM_THREADS")


def test_physical_cores_reads_cpuinfo():
    count = cli_threads.physical_cores()
    if count is None:
        pytest.skip("no /proc/cpuinfo topology here")
    assert 1 <= count <= (os.cpu_count() or count)


# -- GGUF hint -------------------------------------------------------------------------------------------------

def test_a_gguf_folder_says_how_to_convert(tmp_path):
    from kiln.optimizer.loader import load_checkpoint
    from tests.conftest import refused

    (tmp_path / "Model.Q4_1.gguf").write_bytes(b"GGUF")
    message = refused(load_checkpoint, tmp_path, match="has no config.json")
    assert "Model.Q4_1.gguf (GGUF" in message and "gguf_file='Model.Q4_1.gguf'" in message
    (tmp_path / "to_hf.py").write_text("")
    message = refused(load_checkpoint, tmp_path, match="has no config.json")
    assert "convert it with its script: python " in message and "to_hf.py OUT, then build OUT" in message
    (tmp_path / "Model.Q4_1.gguf").unlink()
    (tmp_path / "to_hf.py").unlink()
    assert "GGUF" not in refused(load_checkpoint, tmp_path, match="is it a Hugging Face checkpoint directory?")


# -- exports: the version that wrote config.json, the loaders that read the layout ----------------------------

@pytest.fixture(scope="module")
def stories_plain(tmp_path_factory):
    """stories260K with no passes: its config.json claims transformers 5.24.0."""
    from kiln.optimizer.build import build
    from tests.conftest import STORIES

    if not (STORIES / "config.json").is_file():
        pytest.skip("../shared/models absent")
    return build(STORIES, "hopper", "none", tmp_path_factory.mktemp("fc") / "art", gate=False).path


@pytest.mark.parametrize("fmt", ["compressed-tensors", "hf-modelopt"])
def test_exports_name_their_writer_and_their_loaders(stories_plain, tmp_path, cli, fmt):
    import json
    from importlib.metadata import version

    from kiln.optimizer.export import export

    source = json.loads((stories_plain / "config.json").read_text())["transformers_version"]
    out = export(stories_plain, fmt, tmp_path / fmt)
    written = json.loads((out / "config.json").read_text())["transformers_version"]
    assert written == version("transformers") and written != source
    readme = (out / "README.md").read_text()
    code, text, err = cli("inspect", str(out))
    assert code == 0, err
    names = ("vLLM", "SGLang", "TensorRT-LLM", "ModelOpt") if fmt == "hf-modelopt" else ("vLLM", "SGLang")
    for name in names:
        assert name in readme and name in text, name
    if fmt == "hf-modelopt":
        assert "does NOT read it" in readme and "does NOT read it" in " ".join(text.split())
    code, text, _ = cli("inspect", str(out), "--json")
    assert json.loads(text)["format"] == fmt and json.loads(text)["transformers_version"] == written


# -- the Python API computes as the CLI does -------------------------------------------------------------------

def test_python_api_builds_the_cli_bytes(tmp_path):
    """`kiln.optimizer.build` in a fresh interpreter stores the bytes `optimize build` stores: importing
    kiln.optimizer pins MKL's and OpenBLAS's code paths (optimizer.numerics) as the CLI's main does."""
    import hashlib
    import subprocess
    import sys

    from kiln.optimizer.numerics import CPU_NUMERICS
    from tests.conftest import ROOT, STORIES

    if not (STORIES / "config.json").is_file():
        pytest.skip("../shared/models absent")
    env = {k: v for k, v in os.environ.items() if k not in CPU_NUMERICS}  # fresh processes, nothing pinned
    env["OMP_NUM_THREADS"] = "1"
    common = {"cwd": ROOT, "env": env, "capture_output": True, "text": True, "timeout": 900}
    cli_out, api_out = tmp_path / "cli", tmp_path / "api"
    proc = subprocess.run([sys.executable, "-m", "kiln.optimizer.cli", "build", str(STORIES), "--recipe",
                           "fp8-weights", "-o", str(cli_out), "--no-gate", "--reproducible", "--calib-tokens", "600"],
                          check=False, **common)
    assert proc.returncode == 0, proc.stderr
    code = ("import sys; from kiln.optimizer.build import build; "
            "build(sys.argv[1], 'hopper', 'fp8-weights', sys.argv[2], gate=False, reproducible=True, "
            "calib_tokens=600)")
    proc = subprocess.run([sys.executable, "-c", code, str(STORIES), str(api_out)], check=False, **common)
    assert proc.returncode == 0, proc.stderr

    def digest(path):
        return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()

    assert digest(api_out) == digest(cli_out)


def test_importing_after_torch_warns_at_a_build_not_at_import():
    """lm-eval and scripts that only load an artifact import torch first and build nothing: no warning then; a
    Python build in such a process is told its bytes may differ from the CLI's."""
    from kiln.optimizer.numerics import CPU_NUMERICS

    env = {k: v for k, v in os.environ.items() if k not in CPU_NUMERICS}
    code = ("import warnings, torch\nimport kiln.optimizer\nfrom kiln.optimizer.numerics import warn_if_unpinned\n"
            "warnings.simplefilter('error')\nprint('imported')\nwarn_if_unpinned()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert proc.stdout.strip() == "imported", proc.stderr
    if has_avx2():  # elsewhere nothing is pinned, so nothing is said
        assert proc.returncode != 0 and "imported before kiln.optimizer" in proc.stderr
