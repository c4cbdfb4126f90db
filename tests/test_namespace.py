"""Kiln installs as one `kiln` namespace: its folders never take the top-level names `kernels`, `runtime` or
`optimizer`, which other PyPI projects own (Hugging Face's `kernels` is imported by transformers)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def _run(code: str, cwd) -> subprocess.CompletedProcess:
    # a neutral working directory: the repository root is not on sys.path there
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=300,
                          check=False)


def test_the_top_level_names_are_not_kilns(tmp_path):
    code = ("import importlib.util, kiln, kiln.kernels, kiln.runtime, kiln.optimizer.cli, kiln.passes.base, "
            "kiln.calibration.gptq\n"
            "for name in ('kernels', 'runtime', 'optimizer', 'passes', 'calibration'):\n"
            "    spec = importlib.util.find_spec(name)\n"
            f"    assert spec is None or not (spec.origin or '').startswith({str(ROOT)!r}), (name, spec.origin)\n"
            "print(kiln.kernels.__file__)")
    proc = _run(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith(str(ROOT / "kernels"))


def _has_hf_kernels() -> bool:
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _has_hf_kernels(), reason="Hugging Face's `kernels` is not installed (pip install kernels)")
def test_hugging_face_kernels_and_kiln_import_side_by_side(tmp_path):
    code = ("import kernels, transformers, kiln.kernels.nvfp4, kiln.optimizer.cli\n"
            "from transformers import LlamaConfig, LlamaForCausalLM\n"
            "LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,"
            " num_attention_heads=2))\n"
            "assert 'kiln' not in kernels.__file__ and hasattr(kernels, 'get_kernel'), kernels.__file__\n"
            "print(kernels.__file__)")
    proc = _run(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "site-packages" in proc.stdout
