"""fp8-kv / nvfp4-kv from the CLI: the artifact carries the KV format and scales, the runtime stores the
cache that way, report.md and `optimize inspect` show KV bytes per token and concurrency."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from kiln import runtime
from kiln.optimizer.defaults import SAMPLE_TEXT

torch.set_num_threads(1)


def test_fp8_kv_build_inspect_and_run(cli, generated_checkpoint, tmp_path):
    out = tmp_path / "kv"
    code, stdout, stderr = cli("build", generated_checkpoint, "--recipe", "fp8-weights,fp8-kv", "-o", out,
                               "--eval-data", SAMPLE_TEXT, "--calib-data", SAMPLE_TEXT, "--min-recovery", "0.5",
                               "--force")  # a model of random weights reads no text
    assert code == 0, stderr
    assert "kv-cache" in stdout and "KV cache bytes/token" in stdout and "max concurrent sequences" in stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kv_cache"]["0"]["format"] == "fp8_e4m3"
    assert manifest["kv_cache"]["1"]["scale_tensors"] == {"k": "model.layers.1.self_attn.k_scale",
                                                          "v": "model.layers.1.self_attn.v_scale"}
    tensors = load_file(out / "model.safetensors")
    assert tensors["model.layers.0.self_attn.k_scale"].shape == () and "model.layers.0.self_attn.v_offset" in tensors
    report = (out / "report.md").read_text()
    assert "## KV cache" in report and "| total | | | 256 | 128 (0.500x) |" in report

    code, stdout, _ = cli("inspect", out, "--json")
    info = json.loads(stdout)
    # 2 layers x 4 KV heads x head_dim 8 x (K + V): 256 bytes in BF16, 128 in FP8
    assert (info["kv_bytes_per_token"], info["source_kv_bytes_per_token"]) == (128, 256)
    assert info["kv_cache"]["layers"]["1"]["bytes_per_token"] == 64
    rows = info["kv_cache"]["max_concurrent_sequences"]
    assert {(r["device"], r["context"]) for r in rows} == {(d, c) for d in ("H100-80GB", "H200-141GB", "B200-192GB")
                                                           for c in (4096, 32768)}
    assert all(r["artifact"] >= 2 * r["source"] - 1 for r in rows)
    code, stdout, _ = cli("inspect", out)
    assert code == 0 and "max concurrent sequences" in stdout

    engine = runtime.load(out)
    assert all(s.format == "fp8_e4m3" for layer in engine.kv_streams for s in layer)
    assert engine.kv_pool.pools[0][1].data.dtype == torch.float8_e4m3fn
    code, stdout, _ = cli("generate", out, "Once upon a time", "--max-new-tokens", "5")
    assert code == 0 and stdout.startswith("Once upon a time")


def test_artifact_without_kv_pass_reads_as_bf16(cli, generated_checkpoint, tmp_path):
    out = tmp_path / "plain"
    code, _, stderr = cli("build", generated_checkpoint, "--recipe", "fp8-weights", "-o", out, "--no-gate")
    assert code == 0, stderr
    info = json.loads(cli("inspect", out, "--json")[1])
    assert info["kv_bytes_per_token"] == info["source_kv_bytes_per_token"] == 256
    assert all(r["format"] == "bf16" for r in info["kv_cache"]["layers"].values())
