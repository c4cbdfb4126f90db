"""Kiln's exports through a real vLLM (its CPU build, in a venv of its own): `-m vllm`, not in the default run.

vLLM 0.32's CPU attention has no kernel for stories260K's head size of 8, so the model is a small random
Llama with heads of 64 and stories260K's tokenizer. benchmarks/vllm_check.py scores the export through vLLM's
prompt_logprobs and the artifact through Kiln's runtime on the same ids, and decodes the same prompts greedily
on both. The vLLM python is $KILN_VLLM_PYTHON, else ~/vllm-venv/bin/python (docs/exports.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.optimizer.defaults import EVALUATION_TEXT, SAMPLE_TEXT, STORIES260K, shared_dir
from tests.tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("KILN_VLLM_PYTHON", Path.home() / "vllm-venv" / "bin" / "python"))
OPTIMIZE = shutil.which("optimize") or str(Path(sys.executable).parent / "optimize")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    if not VLLM_PYTHON.is_file():
        pytest.skip(f"no vLLM venv at {VLLM_PYTHON} (docs/exports.md says how to make one)")
    probe = subprocess.run([str(VLLM_PYTHON), "-c", "import vllm"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"vLLM does not import from {VLLM_PYTHON}: {probe.stderr.strip().splitlines()[-1:]}")
    return VLLM_PYTHON


# a small random Llama that vLLM's CPU attention takes (heads of 64)
SMALL_LLAMA = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 64, "vocab_size": 512, "initializer_range": 0.1, "bos_token_id": 1, "eos_token_id": 2}


def stories_llama(path: Path, **overrides) -> Path:
    """A random Llama (SMALL_LLAMA with `overrides`) written to `path` with stories260K's tokenizer."""
    if shared_dir() is None:
        pytest.skip("needs ../shared for stories260K's tokenizer")
    make_tiny_checkpoint("llama", path, overrides={**SMALL_LLAMA, **overrides})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES260K / name, path / name)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return stories_llama(tmp_path_factory.mktemp("llama64") / "ckpt")


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory) -> Path:
    """16 heads of 64 and 8 KV heads: 1024 KV values a token per layer, which DeepSeek's 512 + 64 cuts."""
    return stories_llama(tmp_path_factory.mktemp("llama-wide") / "ckpt", hidden_size=1024, intermediate_size=2048,
                         num_attention_heads=16, num_key_value_heads=8, num_hidden_layers=2)


def check(vllm_python: Path, artifact: Path, tmp: Path, fmt: str, dtype: str = "float32",
          disable_ops: tuple[str, ...] = ()) -> dict:
    out = tmp / f"{fmt}-{dtype}.json"
    text = EVALUATION_TEXT if EVALUATION_TEXT.is_file() else SAMPLE_TEXT
    ops = [arg for op in disable_ops for arg in ("--disable-vllm-op", op)]
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vllm_check.py"), str(artifact), "--format", fmt,
                           *ops,
                           "--dtype", dtype, "--vllm-python", str(vllm_python), "--data", str(text),
                           "--paragraphs", "20", "--prompts", "4", "--new-tokens", "16", "--json", str(out)],
                          capture_output=True, text=True, env=ENV, check=False, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("recipe, fmt, dtype, method", [
    ("none", "compressed-tensors", "float32", None),
    ("fp8", "compressed-tensors", "float32", "compressed-tensors"),
    ("fp8", "hf-modelopt", "bfloat16", "modelopt"),
])
def test_vllm_runs_the_export_with_kilns_figures(vllm_python, checkpoint, tmp_path, recipe, fmt, dtype, method):
    artifact = tmp_path / "artifact"
    build = subprocess.run([OPTIMIZE, "build", str(checkpoint), "--recipe", recipe, "--no-gate", "--calib-tokens",
                            "2048", "-o", str(artifact)], capture_output=True, text=True, env=ENV, check=False)
    assert build.returncode == 0, build.stderr[-2000:]
    result = check(vllm_python, artifact, tmp_path, fmt, dtype)
    assert result["quantization"] == method
    # fp32 on both sides: the same arithmetic but for summation order (and, for W8A8, per-token activation
    # rounding at a different point); bf16 in vLLM against fp32 in Kiln: within bf16's rounding
    assert abs(result["relative"]) < (0.005 if dtype == "float32" else 0.02), result
    assert all(p["near_tie"] for p in result["partings"]) or dtype != "float32", result["partings"]


def test_vllm_runs_a_deepseek_layout_mla_conversion_with_kilns_figures(vllm_python, wide_checkpoint, tmp_path):
    """`mla` with `layout: deepseek` (rank 512 + rotary 64 in both layers, 2048 -> 1152 KV values a token)
    exported --format hf: vLLM's CPU build serves it with its CPU_MLA backend (576 only)."""
    recipe = tmp_path / "mla.yaml"
    recipe.write_text("passes:\n  - {pass: mla, kv_fraction: 0.5625, layout: deepseek, heal_steps: 0}\n")
    artifact = tmp_path / "artifact"
    build = subprocess.run([OPTIMIZE, "build", str(wide_checkpoint), "--recipe", str(recipe), "--no-gate",
                            "--calib-tokens", "2048", "-o", str(artifact)], capture_output=True, text=True, env=ENV,
                           check=False)
    assert build.returncode == 0, build.stderr[-2000:]
    arch = json.loads((artifact / "manifest.json").read_text())["architecture"]
    assert {(a["attention"]["kv_lora_rank"], a["attention"]["qk_rope_head_dim"]) for a in arch["layers"]} == {(512, 64)}
    # vLLM 0.32's CPU rotary_embedding op rotates a [tokens, heads, 64] query wrongly when heads > 1 (right only
    # flattened, as Llama passes it), and its DeepSeek MLA layer passes q_pe that way; with vLLM's PyTorch
    # rotary instead, its logprobs equal transformers' on the export (benchmarks/results/vllm.md)
    result = check(vllm_python, artifact, tmp_path, "hf", disable_ops=("rotary_embedding",))
    assert abs(result["relative"]) < 0.005, result
    assert all(p["near_tie"] for p in result["partings"]), result["partings"]


def test_vllm_runs_an_eagle3_head_over_a_draft_vocabulary_losslessly(vllm_python, tmp_path):
    """A draft-head build (EAGLE-3, a draft vocabulary of 128 of the 512 tokens) exported with --format eagle3
    runs as vLLM's speculative method eagle3 beside the checkpoint: vLLM's greedy output is Kiln's plain greedy
    decoding, and its acceptance length is Kiln's tau on the same prompts within 0.1."""
    checkpoint = stories_llama(tmp_path / "ckpt", num_hidden_layers=4)  # an EAGLE-3 head reads three layers
    recipe = tmp_path / "eagle3.yaml"
    recipe.write_text("passes:\n  - {pass: draft-head, architecture: eagle3, draft_vocab: 128, train_steps: 40, "
                      "generated: 16, generated_tokens: 32, min_tau: 1.0}\n")
    art = tmp_path / "art"
    build = subprocess.run([OPTIMIZE, "build", str(checkpoint), "--recipe", str(recipe), "--no-gate", "--calib-tokens",
                            "4096", "-o", str(art)], capture_output=True, text=True, env=ENV, check=False, timeout=900)
    assert build.returncode == 0, build.stderr[-2000:]
    out = tmp_path / "eagle3.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vllm_eagle3.py"), str(art), "--vllm-python",
                           str(vllm_python), "--prompts", "4", "--new-tokens", "24", "--json", str(out)],
                          capture_output=True, text=True, env=ENV, check=False, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures["identical"] == figures["prompts"] == 4
    assert figures["kiln"]["steps"] == figures["vllm"]["steps"]
    assert abs(figures["kiln"]["tau"] - figures["vllm"]["acceptance_length"]) < 0.1
