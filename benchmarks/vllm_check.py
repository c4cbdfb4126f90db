"""An export through vLLM and through Kiln's runtime on the same token ids: perplexity, greedy tokens, load time.

    python benchmarks/vllm_check.py ARTIFACT|EXPORT_DIR [--format compressed-tensors] [--dtype float32]
        [--vllm-python ~/vllm-venv/bin/python] [--paragraphs 200] [--prompts 16] [--new-tokens 64] [--out FILE.md]

Two processes, because vLLM needs transformers >= 5.16 and Kiln pins < 5.15 (for ModelOpt): this script runs in
Kiln's venv and scores the artifact through Kiln's runtime (`optimize eval`'s loop, `kiln.optimizer.measure.gate.score`);
it then runs itself again under `--vllm-python` with `--vllm-side`, which imports vLLM only (not Kiln), scores
the same ids through vLLM's `prompt_logprobs` and decodes the same prompts greedily. The two halves exchange JSON.
docs/exports.md gives the venv recipe.

ARTIFACT is exported to a temporary folder in --format first; an EXPORT_DIR (a Kiln export: its
kiln_export.json names the artifact it came from) is checked as it is. Greedy continuations are compared token
for token; where they part, the gap between the two most likely tokens at that position (Kiln's logits,
log-probabilities) says whether it is a near-tie (under --near-tie nats): a near-tie may go either way on
another engine's arithmetic, a clear gap may not. On an artifact that rounds to FP8 at run time (W8A8's dynamic
per-token activations, an FP8 KV cache) a parting is also "decided by FP8 rounding" when that rounding moves
Kiln's log-probability margin of its token over vLLM's (against the same weights with activations and K/V
unrounded) by at least that margin: each rounded element sits on an FP8 step, so a last-bit difference upstream
(another engine's summation order) can move it a whole step, and such a choice can go either way.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EVALUATION_TEXT = ROOT.parent / "shared" / "data" / "tinystories" / "evaluation.txt"
DEFAULT_VLLM_PYTHON = Path.home() / "vllm-venv" / "bin" / "python"
NEAR_TIE = 0.1
"""Nats between the two most likely tokens under which a parting of greedy paths counts as a near-tie."""
PROMPT_TOKENS = 16


# --- the vLLM half: runs in vLLM's venv and imports nothing of Kiln's ---------------------------------------
def vllm_side(request_path: Path, result_path: Path) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    request = json.loads(request_path.read_text())
    started = time.perf_counter()
    extra = {}
    if request.get("disable_ops"):
        # vLLM's own PyTorch forward for these ops instead of its custom (C++/CPU) kernels
        extra["compilation_config"] = {"custom_ops": ["all", *(f"-{op}" for op in request["disable_ops"])]}
    if request.get("kv_cache_dtype"):
        extra["kv_cache_dtype"] = request["kv_cache_dtype"]
    llm = LLM(model=request["model"], dtype=request["dtype"], max_model_len=request["max_model_len"],
              enforce_eager=request["enforce_eager"], seed=0, **extra)
    load_seconds = time.perf_counter() - started
    config = llm.llm_engine.model_config
    quantization = getattr(config, "quantization", None)

    scoring = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in request["paragraphs"]], scoring,
                           use_tqdm=False)
    nll = []
    for ids, output in zip(request["paragraphs"], outputs, strict=True):
        # prompt_logprobs[i] holds position i's token given the ones before it (None for the first)
        nll.append(-sum(entry[token].logprob for token, entry in zip(ids[1:], output.prompt_logprobs[1:],
                                                                      strict=True)))
    greedy_params = SamplingParams(max_tokens=request["new_tokens"], temperature=0.0, ignore_eos=True, logprobs=2)
    started = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]], greedy_params,
                           use_tqdm=False)
    greedy_seconds = time.perf_counter() - started
    greedy = []
    for output in outputs:
        completion = output.outputs[0]
        top2 = [sorted((lp.logprob for lp in step.values()), reverse=True)[:2] for step in completion.logprobs]
        greedy.append({"tokens": list(completion.token_ids), "top2": top2})
    result_path.write_text(json.dumps({"load_seconds": load_seconds, "quantization": quantization,
                                       "nll": nll, "greedy": greedy, "greedy_seconds": greedy_seconds}))


# --- the Kiln half ----------------------------------------------------------------------------------------
def kiln_side(artifact: Path, data: Path, paragraphs: int, prompts: int, new_tokens: int) -> dict:
    import torch

    from kiln import runtime
    from kiln.calibration.data import load_token_lists, token_cap
    from kiln.optimizer.measure.gate import score

    started = time.perf_counter()
    engine = runtime.load(artifact)
    load_seconds = time.perf_counter() - started
    cap = token_cap(engine.spec.max_position_embeddings)
    token_lists = load_token_lists(engine.require_tokenizer(), data, paragraphs, cap)
    per_paragraph = [score(engine, [ids]).nll for ids in token_lists]
    chosen = [ids[:PROMPT_TOKENS] for ids in token_lists if len(ids) >= PROMPT_TOKENS][:prompts]
    started = time.perf_counter()
    greedy = [out for out, _ in engine.generate_ids(chosen, new_tokens, repetition_penalty=1.0)]
    greedy_seconds = time.perf_counter() - started

    def top2_gap(prefix: list[int]) -> float:
        logits = engine.logits([prefix])[0][-1].float()
        top = torch.log_softmax(logits, -1).topk(2).values
        return float(top[0] - top[1])

    # W8A8 (dynamic per-token FP8 activations) or an FP8 KV cache: the same weights with activations and cached
    # K/V left unrounded, to measure how far that rounding alone moves the choice at a parting
    manifest = json.loads((artifact / "manifest.json").read_text())
    w8a8 = any(str(e.get("activation", "none")).startswith("fp8_dynamic") for e in manifest["formats"].values())
    kv8 = any(row.get("format") == "fp8_e4m3" for row in (manifest.get("kv_cache") or {}).values())
    unrounded = None
    if w8a8 or kv8:
        from kiln.kernels import fp8

        shipped = fp8.fp8_fake_quantize_per_token
        if w8a8:
            fp8.fp8_fake_quantize_per_token = lambda x: x  # read when the engine builds its linears
        try:
            unrounded = runtime.load(artifact, kv_cache={} if kv8 else None)
        finally:
            fp8.fp8_fake_quantize_per_token = shipped

    def pair_gaps(prefix: list[int], ours: int, theirs: int) -> tuple[float, float | None]:
        """(log p(ours) - log p(theirs) as shipped, and the same with activations unrounded; None for W8A16)."""
        out = []
        for e in (engine, unrounded):
            if e is None:
                out.append(None)
                continue
            logp = torch.log_softmax(e.logits([prefix])[0][-1].float(), -1)
            out.append(float(logp[ours] - logp[theirs]))
        return out[0], out[1]

    return {"engine": engine, "load_seconds": load_seconds, "paragraphs": token_lists, "nll": per_paragraph,
            "prompts": chosen, "greedy": greedy, "top2_gap": top2_gap, "pair_gaps": pair_gaps,
            "greedy_seconds": greedy_seconds,
            "max_model_len": min(engine.spec.max_position_embeddings, max(cap, PROMPT_TOKENS + new_tokens))}


def resolve(path: Path, fmt: str, workdir: Path) -> tuple[Path, Path]:
    """(artifact, export dir): an export's marker names its artifact; an artifact is exported in `fmt`."""
    marker = path / "kiln_export.json"
    if marker.is_file():
        return Path(json.loads(marker.read_text())["artifact"]), path
    if not (path / "manifest.json").is_file():
        sys.exit(f"error: {path} is neither a Kiln artifact (manifest.json) nor a Kiln export (kiln_export.json)")
    from kiln.optimizer.export import export

    return path, export(path, fmt, workdir / f"export-{fmt}")


def vllm_refusal(log: str) -> str:
    """vLLM's own reason for refusing a model: the first `SomeError: message` its processes logged that is not
    one of the wrappers that repeat it (engine start-up failed, engine dead)."""
    import re

    wrappers = ("Engine core initialization failed", "EngineCore encountered an issue", "WorkerProc initialization")
    for match in re.finditer(r"\b(\w*(?:Error|Exception)): (.+)", log):
        if not any(w in match.group(2) for w in wrappers):
            return f"{match.group(1)}: {match.group(2).strip()}"
    lines = log.strip().splitlines()
    return lines[-1] if lines else "no output"


def compare(kiln: dict, vllm: dict, near_tie: float) -> dict:
    tokens = sum(len(ids) - 1 for ids in kiln["paragraphs"])
    kiln_ppl = float(__import__("math").exp(sum(kiln["nll"]) / tokens))
    vllm_ppl = float(__import__("math").exp(sum(vllm["nll"]) / tokens))
    identical, partings = 0, []
    for i, (prompt, ours, theirs) in enumerate(zip(kiln["prompts"], kiln["greedy"], vllm["greedy"], strict=True)):
        theirs_tokens = theirs["tokens"]
        if ours == theirs_tokens:
            identical += 1
            continue
        at = next((j for j, (a, b) in enumerate(zip(ours, theirs_tokens)) if a != b), min(len(ours),
                                                                                          len(theirs_tokens)))
        prefix = list(prompt) + ours[:at]
        gap = kiln["top2_gap"](prefix)
        vllm_top2 = theirs["top2"][at] if at < len(theirs["top2"]) else []
        vllm_gap = vllm_top2[0] - vllm_top2[1] if len(vllm_top2) == 2 else float("nan")
        parting = {"prompt": i, "position": at, "kiln_gap": gap, "vllm_gap": vllm_gap, "near_tie": gap < near_tie}
        if at < min(len(ours), len(theirs_tokens)):
            shipped, unrounded = kiln["pair_gaps"](prefix, ours[at], theirs_tokens[at])
            if unrounded is not None:
                # decided by FP8 rounding: rounding the activations (and the cached K/V) moves Kiln's preference
                # for its token over vLLM's by at least that preference itself, so another engine's last-bit
                # differences before the quantizers may land on either side
                parting.update(pair_gap=shipped, activation_shift=abs(shipped - unrounded),
                               rounding=abs(shipped - unrounded) >= shipped)
        partings.append(parting)
    return {"tokens": tokens, "kiln_perplexity": kiln_ppl, "vllm_perplexity": vllm_ppl,
            "relative": vllm_ppl / kiln_ppl - 1, "identical": identical, "prompts": len(kiln["prompts"]),
            "partings": partings}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, nargs="?", help="a Kiln artifact or a Kiln export directory")
    parser.add_argument("--format", default="compressed-tensors",
                        help="export format for an ARTIFACT: compressed-tensors, hf-modelopt or hf")
    parser.add_argument("--dtype", default="float32", help="vLLM's dtype (its modelopt method needs bfloat16)")
    parser.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--data", type=Path, default=EVALUATION_TEXT)
    parser.add_argument("--paragraphs", type=int, default=200)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--near-tie", type=float, default=NEAR_TIE)
    parser.add_argument("--compile", action="store_true", help="let vLLM compile (default: enforce_eager)")
    parser.add_argument("--disable-vllm-op", action="append", default=[], metavar="OP",
                        help="run vLLM's PyTorch forward for this custom op (repeatable). vLLM 0.32's CPU "
                             "rotary_embedding op rotates a [tokens, heads, 64] query wrongly when heads > 1, "
                             "as its DeepSeek MLA layer passes it: check an MLA export with rotary_embedding")
    parser.add_argument("--kv-cache-dtype", help="vLLM's kv_cache_dtype (default: fp8 when the export carries "
                        "FP8 KV scales, else auto)")
    parser.add_argument("--out", type=Path, help="also append the table row to this Markdown file")
    parser.add_argument("--json", type=Path, help="also write the whole comparison as JSON")
    parser.add_argument("--vllm-side", nargs=2, type=Path, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.vllm_side:
        vllm_side(*opts.vllm_side)
        return 0
    if opts.path is None:
        parser.error("ARTIFACT or EXPORT_DIR is required")
    if not opts.vllm_python.is_file():
        sys.exit(f"error: no vLLM python at {opts.vllm_python}; see docs/exports.md for the venv, or pass "
                 "--vllm-python")
    with tempfile.TemporaryDirectory(prefix="kiln-vllm-check-") as tmp:
        work = Path(tmp)
        artifact, exported = resolve(opts.path, opts.format, work)
        kiln = kiln_side(artifact, opts.data, opts.paragraphs, opts.prompts, opts.new_tokens)
        kv_dtype = opts.kv_cache_dtype
        if kv_dtype is None:  # an export with FP8 KV scales: vLLM stores the cache in FP8 only when told to
            quant = json.loads((Path(exported) / "config.json").read_text()).get("quantization_config") or {}
            kv_dtype = "fp8" if quant.get("kv_cache_scheme") else "auto"
        request = {"kv_cache_dtype": kv_dtype, "model": str(exported), "dtype": opts.dtype,
                   "max_model_len": kiln["max_model_len"],
                   "enforce_eager": not opts.compile, "paragraphs": kiln["paragraphs"], "prompts": kiln["prompts"],
                   "new_tokens": opts.new_tokens, "disable_ops": opts.disable_vllm_op}
        (work / "request.json").write_text(json.dumps(request))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        # vLLM's CPU backend otherwise reserves 92% of the machine's memory for its KV cache, and refuses to
        # start when anything else holds more than 8%: 1 GiB holds every request this script sends
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        proc = subprocess.run([str(opts.vllm_python), __file__, "--vllm-side", str(work / "request.json"),
                               str(work / "result.json")], env=env, cwd=work, capture_output=True, text=True,
                              check=False)
        if proc.returncode != 0:
            reason = vllm_refusal(proc.stderr + proc.stdout)
            print(f"| {opts.path.name} | {opts.format} | {opts.dtype} | refused by vLLM: {reason} |")
            (Path(opts.json).write_text(json.dumps({"refused": str(reason)})) if opts.json else None)
            return 3
        vllm = json.loads((work / "result.json").read_text())
    result = compare(kiln, vllm, opts.near_tie)
    result.update(disabled_vllm_ops=opts.disable_vllm_op)
    result.update(quantization=vllm["quantization"], vllm_load_seconds=vllm["load_seconds"],
                  kiln_load_seconds=kiln["load_seconds"], format=opts.format, dtype=opts.dtype,
                  artifact=str(artifact))
    def verdict(p: dict) -> str:
        if p["near_tie"]:
            return "near-tie"
        if p.get("rounding") and p["pair_gap"] <= 0:
            return "decided by FP8 rounding: Kiln's own whole-prefix forward picks vLLM's token"
        if p.get("rounding"):
            return (f"decided by FP8 rounding: it moves Kiln's {p['pair_gap']:.3f} margin over vLLM's token by "
                    f"{p['activation_shift']:.3f}")
        return "NOT a near-tie" + (f", FP8 rounding moves Kiln's {p['pair_gap']:.3f} margin over vLLM's token by "
                                   f"{p['activation_shift']:.3f}"
                                   if "activation_shift" in p else "")

    partings = "; ".join(f"prompt {p['prompt']} at token {p['position']} (gap {p['kiln_gap']:.3f} nats, {verdict(p)})"
                         for p in result["partings"])
    unexplained = sum(1 for p in result["partings"] if not p["near_tie"] and not p.get("rounding"))
    header = ("| artifact | export | dtype | vLLM method | ppl vLLM | ppl Kiln | vLLM/Kiln - 1 | greedy identical | "
              "where they part | load vLLM s | load Kiln s |\n|---|---|---|---|---|---|---|---|---|---|---|")
    ops = "".join(f" (vLLM op {op} off)" for op in opts.disable_vllm_op)
    ops += f", KV cache {kv_dtype}" if kv_dtype != "auto" else ""
    row = (f"| {Path(artifact).name} | {opts.format}{ops} | {opts.dtype} | {result['quantization'] or 'none'} | "
           f"{result['vllm_perplexity']:.4f} | {result['kiln_perplexity']:.4f} | {result['relative']:+.3%} | "
           f"{result['identical']}/{result['prompts']} × {opts.new_tokens} | {partings or '-'} | "
           f"{result['vllm_load_seconds']:.1f} | {result['kiln_load_seconds']:.1f} |")
    print(header)
    print(row)
    print(f"\n{opts.paragraphs} paragraphs of {opts.data.name} ({result['tokens']} scored tokens); "
          f"{result['prompts']} prompts of {PROMPT_TOKENS} tokens, {opts.new_tokens} new; near-tie: under "
          f"{opts.near_tie} nats between the top two tokens (Kiln's logits); partings neither a near-tie nor decided "
          f"by FP8 rounding (activations, KV cache): {unexplained}")
    if opts.out:
        with opts.out.open("a") as fh:
            fh.write(row + "\n")
    if opts.json:
        opts.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
