"""The `optimize` CLI end to end: build/inspect/eval/generate/gate, bad input, strict reverts, determinism."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
import yaml
from safetensors.torch import load_file

from kiln.optimizer.defaults import SAMPLE_TEXT
from kiln.optimizer.numerics import CPU_NUMERICS
from kiln.optimizer.recipes import resolve_recipe
from kiln.passes.base import config_dict
from tests.breakage import MESSAGES, broken_copy
from tests.conftest import EVAL_TEXT, ROOT, STORIES, needs_stories
from tests.optimizer.test_console_script import OPTIMIZE


def _no_leftovers(parent, name):
    return not [p.name for p in parent.iterdir() if p.name.startswith((name, f".{name}"))]


def test_build_inspect_eval_generate(cli, generated_checkpoint, tmp_path):
    out = tmp_path / "art"
    # --force: a model of random weights reads no text (its perplexity is about its vocabulary size)
    code, stdout, stderr = cli("build", generated_checkpoint, "--recipe", "fp8-weights", "-o", out,
                               "--eval-data", SAMPLE_TEXT, "--min-recovery", "0.5", "--force")
    assert code == 0, stderr
    assert "weight-quant" in stdout and "ratio" in stdout
    code, stdout, _ = cli("inspect", out, "--json")
    info = json.loads(stdout)
    assert info["weight_bytes"] < info["source_weight_bytes"]
    layers = info["architecture"]["layers"]  # one entry per layer of the spec the runtime executes
    assert [(e["index"], e["attention"], e["mlp"]) for e in layers] == [(0, "gqa", "dense"), (1, "gqa", "dense")]
    quantizable = [n for n in info["layers"] if n != "lm_head"]
    assert quantizable and all(info["layers"][n] == "fp8_e4m3" for n in quantizable)
    # the built-in recipe: AWQ, GPTQ, then end-to-end tuning of the FP8 grid points (the model fits the budget)
    manifest = json.loads((out / "manifest.json").read_text())
    (record,) = manifest["passes"]
    assert sorted(record["result"]["changed"]) == sorted(quantizable)
    # the build's peak RSS, recorded and printed (a reproducible build leaves it out, as it leaves timings)
    assert 10**8 < manifest["peak_rss_bytes"] < 10**11 and "peak RSS:" in stderr + stdout
    assert all(v == "fp8_e4m3 (awq+gptq+tuned)" for v in record["result"]["changed"].values())
    assert any(n.startswith("tuned 200 steps") for n in record["result"]["notes"])
    code, stdout, _ = cli("eval", out, "--data", SAMPLE_TEXT, "--json", "--force")
    ev = json.loads(stdout)
    assert code == 0 and ev["tokens"] > 50 and ev["perplexity"] > 1
    code, stdout, _ = cli("generate", out, "Once upon a time", "--max-new-tokens", "5")
    assert code == 0 and stdout.startswith("Once upon a time")


def test_two_builds_are_byte_identical(cli, generated_checkpoint, tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b"]
    # the built-in fp8 recipe's passes (GPTQ, AWQ, tuning), with 10 tuning steps rather than 200
    recipe = tmp_path / "fp8.yaml"
    passes = [{**config_dict(p), "tune_steps": 10} for p in resolve_recipe("fp8").passes]
    recipe.write_text(yaml.safe_dump({"name": "fp8", "passes": passes}))
    for d in dirs:
        code, _, err = cli("build", generated_checkpoint, "--recipe", recipe, "-o", d, "--eval-data", SAMPLE_TEXT,
                           "--min-recovery", "0.5", "--reproducible", "--target", "hopper", "--force")
        assert code == 0, err
    names = sorted(p.name for p in dirs[0].iterdir())
    assert names == sorted(p.name for p in dirs[1].iterdir())
    assert {"manifest.json", "model.safetensors", "config.json", "report.md", "tokenizer.json"} <= set(names)
    for name in names:
        assert (dirs[0] / name).read_bytes() == (dirs[1] / name).read_bytes(), name
    manifest = json.loads((dirs[0] / "manifest.json").read_text())
    (record,) = manifest["passes"]
    assert all(v.endswith("(awq+gptq+tuned)") for v in record["result"]["changed"].values())
    # the thread count follows the machine's load unless OMP_NUM_THREADS is set: not part of a reproducible build
    assert "threads" not in manifest["numerics"] and "torch" in manifest["numerics"]
    assert manifest["peak_rss_bytes"] is None


def built_on_one_and_two_threads(tmp_path, passes: list[dict], *args: str) -> None:
    """`optimize build` of stories260K with `passes`, in two processes at once, OMP_NUM_THREADS=1 and 2: the two
    store the same bytes in every tensor."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"name": "two-threads", "passes": passes}))
    env = {k: v for k, v in os.environ.items() if k not in CPU_NUMERICS}  # the CLI pins them itself
    runs = {count: subprocess.Popen(
        [OPTIMIZE, "build", str(STORIES), "--recipe", str(recipe), "-o", str(tmp_path / f"t{count}"),
         "--calib-tokens", "20000", "--reproducible", *args],
        env={**env, "OMP_NUM_THREADS": str(count)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True) for count in (1, 2)}
    try:
        for run in runs.values():
            _, err = run.communicate(timeout=1800)
            assert run.returncode == 0, err
    finally:
        for run in runs.values():
            run.kill()  # a no-op for a process that has ended
    for count in runs:
        numerics = json.loads((tmp_path / f"t{count}" / "manifest.json").read_text())["numerics"]
        assert numerics["mkl_cbwr"] == "AVX2,STRICT" and numerics["openblas_coretype"] == "Haswell", numerics
        assert numerics["openblas_kernels"] == ["Haswell"], numerics
    stored = [load_file(tmp_path / f"t{count}" / "model.safetensors") for count in runs]
    assert stored[0].keys() == stored[1].keys()
    for name, tensor in stored[0].items():
        other = stored[1][name]
        assert torch.equal(tensor.reshape(-1).view(torch.uint8), other.reshape(-1).view(torch.uint8)), name


@pytest.mark.slow
@needs_stories
def test_a_tuned_build_on_two_threads_stores_what_one_thread_does(tmp_path):
    # `optimize` pins MKL's strict mode and tunes on one thread: the auto recipe's stored weights do not depend
    # on the thread count. They used to: a tuned norm's gradient, summed in another order, moved the tuned grid
    # points (a random tiny model is too small for torch to split its sums). Two processes, as users run it
    built_on_one_and_two_threads(
        tmp_path, [{"pass": "auto-precision", "weight_bits": 5.0, "method": "gptq", "tune_steps": 20,
                    "tune_embedding": True}], "--eval-data", str(EVAL_TEXT), "--paragraphs", "50")


@needs_stories
def test_an_awq_gptq_build_on_two_threads_stores_what_one_thread_does(tmp_path):
    # AWQ's search and GPTQ read the activations a calibration observes: they followed the thread count through
    # torch's CPU silu (runtime.activations.silu) and OpenBLAS's factorization (calibration.gptq.one_blas_thread);
    # before those, most of this build's tensors from layer 2 on differed
    built_on_one_and_two_threads(
        tmp_path, [{"pass": "weight-quant", "format": "fp8", "method": "gptq", "awq": True,
                    "true_sequential": False, "tune_steps": 0}], "--no-gate")


@pytest.mark.parametrize("kind, message", [*MESSAGES.items(), ("unknown recipe", "unknown recipe 'fp7'")])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(cli, generated_checkpoint, tmp_path, kind, message):
    unknown_recipe = kind == "unknown recipe"
    ckpt = broken_copy(generated_checkpoint, tmp_path / "ckpt", "intact" if unknown_recipe else kind)
    recipe = "fp7" if unknown_recipe else "fp8-weights"
    outdir = tmp_path / "outs"
    outdir.mkdir()
    code, _stdout, stderr = cli("build", ckpt, "--recipe", recipe, "-o", outdir / "art", "--eval-data", SAMPLE_TEXT)
    assert code == 2
    assert stderr.startswith("error: ") and message in stderr
    assert stderr.count("\n") == 1 and "Traceback" not in stderr
    assert list(outdir.iterdir()) == []


@pytest.mark.parametrize("device, message", [
    ("cuda", "no CUDA GPU"), ("tpu", "unknown device 'tpu'"), ("meta", "a build runs on cpu or cuda")])
def test_build_device_is_checked_before_anything_loads(cli, generated_checkpoint, tmp_path, device, message):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    out = tmp_path / "art"
    code, _, stderr = cli("build", generated_checkpoint, "--device", device, "-o", out, "--eval-data", SAMPLE_TEXT)
    assert code == 2 and stderr.startswith("error: ") and message in stderr and stderr.count("\n") == 1
    assert not out.exists()


def test_corrupted_artifact_is_refused(cli, generated_checkpoint, tmp_path):
    out = tmp_path / "art"
    assert cli("build", generated_checkpoint, "--recipe", "none", "-o", out, "--no-gate")[0] == 0
    data = bytearray((out / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (out / "model.safetensors").write_bytes(bytes(data))
    for args in (("inspect", out), ("generate", out, "hi"), ("eval", out, "--data", SAMPLE_TEXT)):
        code, _, stderr = cli(*args)
        assert code == 2 and "checksum mismatch for model.safetensors" in stderr and stderr.count("\n") == 1


@needs_stories
def test_strict_revert_exits_1_and_writes_nothing(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the recipe names its custom pass as module:Class, resolved from the cwd
    recipe = tmp_path / "destructive.yaml"
    recipe.write_text("passes:\n  - pass: tests.passes.destructive:Scramble\n    noise: 3.0\n")
    common = ("--recipe", recipe, "--allow-custom-passes", "--eval-data", EVAL_TEXT, "--paragraphs", "60",
              "--min-recovery", "0.9")
    code, _stdout, stderr = cli("build", STORIES, "-o", tmp_path / "strict", "--strict", *common)
    assert code == 1 and "reverted" in stderr and "Traceback" not in stderr
    assert _no_leftovers(tmp_path, "strict")
    code, _stdout, stderr = cli("build", STORIES, "-o", tmp_path / "lenient", *common)
    assert code == 0, stderr
    manifest = json.loads((tmp_path / "lenient" / "manifest.json").read_text())
    (record,) = manifest["passes"]
    assert record["decision"] == "reverted" and len(record["attempts"]) == 3
    assert [a["config"]["noise"] for a in record["attempts"]] == [3.0, 1.5, 1.5]
    assert all(not a["gate"]["passed"] for a in record["attempts"])
    # reverted: the artifact holds the source weights unchanged
    stored = load_file(tmp_path / "lenient" / "model.safetensors")
    source = load_file(STORIES / "model.safetensors")
    assert all(torch.equal(stored[k], v) for k, v in source.items())


@needs_stories
def test_gate_command_on_the_real_model(cli, tmp_path):
    out = tmp_path / "fp8"
    assert cli("build", STORIES, "--recipe", "fp8-weights", "-o", out, "--paragraphs", "100",
               "--eval-data", EVAL_TEXT)[0] == 0
    args = ("gate", out, "--baseline", STORIES, "--data", EVAL_TEXT, "--paragraphs", "100", "--json")
    code, stdout, _ = cli(*args, "--min-recovery", "0.98")
    result = json.loads(stdout)
    assert code == 0 and {"recovery", "perplexity", "baseline_perplexity", "kl", "top1"} <= set(result)
    assert 0.98 < result["recovery"] < 1.0 and 0 < result["kl"] < 0.05 and 0.9 < result["top1"] < 1
    code, stdout, stderr = cli(*args, "--min-recovery", "0.9999")
    assert code == 1 and "below the floor" in stderr


def test_console_script_prints_no_traceback(tmp_path):
    exe = OPTIMIZE
    proc = subprocess.run([exe, "build", str(tmp_path / "missing"), "-o", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "Traceback" not in proc.stderr
