"""An artifact's EAGLE-3 draft head through vLLM's speculative decoding, beside Kiln's runtime: acceptance
length against Kiln's tau, and greedy output against plain greedy decoding (issue #17).

    python benchmarks/vllm_eagle3.py ARTIFACT [--target CHECKPOINT] [--vllm-python ~/vllm-venv/bin/python]
        [--prompts 16] [--new-tokens 64] [--draft-tokens 4] [--out FILE.md] [--json FILE.json]

The head is exported with `optimize export ARTIFACT --format eagle3` (its d2t draft vocabulary included) and run
as vLLM's `speculative_config={"method": "eagle3", "model": HEAD, "num_speculative_tokens": k}` beside
`--target` (default: the checkpoint the artifact was built from, served dense, since vLLM's CPU build has no
FP8 weight-only kernel). Kiln runs the same head on the same dense target (the artifact's head tensors attached
to the checkpoint's graph), chain drafting, k drafts a step. Prompts: the first 16 tokens of the first
--prompts evaluation paragraphs; --new-tokens tokens, EOS ignored, greedy.

Reported: each engine's verification steps, accepted drafts, acceptance length (1 + accepted / steps: Kiln's tau
on a chain) and vLLM's acceptances by draft position; the outputs of vLLM's speculative decoding against Kiln's
plain greedy decoding, token for token. Two processes, as benchmarks/vllm_check.py: the vLLM half imports
nothing of Kiln's.
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
DEFAULT_VLLM_PYTHON = Path.home() / "vllm-venv" / "bin" / "python"
PROMPT_TOKENS = 16


def vllm_side(request_path: Path, result_path: Path) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    request = json.loads(request_path.read_text())
    started = time.perf_counter()
    llm = LLM(model=request["target"], dtype="float32", max_model_len=request["max_model_len"], enforce_eager=True,
              seed=0, disable_log_stats=False,
              speculative_config={"method": "eagle3", "model": request["head"],
                                  "num_speculative_tokens": request["draft_tokens"]})
    loaded = time.perf_counter() - started
    started = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in request["prompts"]],
                           SamplingParams(temperature=0, max_tokens=request["new_tokens"], ignore_eos=True))
    seconds = time.perf_counter() - started
    metrics = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            metrics[m.name] = list(m.values) if hasattr(m, "values") else m.value
    result_path.write_text(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outputs],
                                       "metrics": metrics, "load_seconds": loaded, "generate_seconds": seconds}))


def kiln_side(artifact: Path, target: Path, prompts: int, new_tokens: int, k: int) -> dict:
    sys.path.insert(0, str(ROOT))
    from safetensors.torch import load_file

    from kiln.calibration.data import load_token_lists
    from kiln.optimizer.defaults import EVALUATION_TEXT
    from kiln.optimizer.loader import load_checkpoint
    from kiln.optimizer.measure.gate import engine_from_graph
    from kiln.passes.draft_head import attach
    from kiln.runtime.artifact import WEIGHTS, read_manifest
    from kiln.runtime.engine import load_tokenizer
    from kiln.runtime.spec import spec_from_json

    module = next(m for m in spec_from_json(read_manifest(artifact)["architecture"]).extra_modules
                  if m.kind == "eagle3")
    head = {n: t for n, t in load_file(str(artifact / WEIGHTS)).items() if n.startswith(module.name + ".")}
    graph = load_checkpoint(target)
    attach(graph, module, head)
    engine = engine_from_graph(graph)
    ids = [t[:PROMPT_TOKENS] for t in load_token_lists(load_tokenizer(target), EVALUATION_TEXT, None)
           if len(t) >= PROMPT_TOKENS][:prompts]
    plain = [out for out, _ in engine.generate_ids(ids, new_tokens, stop_ids=())]
    spec, stats = engine.speculative_ids(ids, new_tokens, k, engine.drafter("head", tree_width=1), stop_ids=())
    if [out for out, _ in spec] != plain:
        raise SystemExit("Kiln's speculative output differs from its plain greedy decoding")
    return {"prompts": ids, "plain": plain, "steps": stats.steps, "accepted": stats.accepted,
            "drafted": stats.drafted, "tau": stats.tau, "max_model_len": engine.spec.max_position_embeddings}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path, nargs="?")
    parser.add_argument("--target", type=Path, help="the dense target vLLM serves (default: the artifact's source)")
    parser.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--out", type=Path, help="also write the Markdown table here")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    parser.add_argument("--vllm-side", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vllm_side:
        vllm_side(*args.vllm_side)
        return 0
    if args.artifact is None:
        parser.error("ARTIFACT is required")
    if not args.vllm_python.is_file():
        raise SystemExit(f"no vLLM venv at {args.vllm_python} (docs/exports.md has the recipe)")
    manifest = json.loads((args.artifact / "manifest.json").read_text())
    target = args.target or Path(manifest["source"]["checkpoint"])
    kiln = kiln_side(args.artifact, target, args.prompts, args.new_tokens, args.draft_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        head = Path(tmp) / "eagle3"
        subprocess.run([sys.executable, "-m", "kiln.optimizer.cli", "export", str(args.artifact), "--format", "eagle3",
                        "-o", str(head)], check=True, cwd=ROOT)
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request.write_text(json.dumps({"target": str(target), "head": str(head), "prompts": kiln["prompts"],
                                       "new_tokens": args.new_tokens, "draft_tokens": args.draft_tokens,
                                       "max_model_len": min(kiln["max_model_len"], 1024)}))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
        run = subprocess.run([str(args.vllm_python), __file__, "--vllm-side", str(request), str(result)], env=env,
                             capture_output=True, text=True, check=False)
        if run.returncode != 0:
            tail = [line for line in run.stderr.splitlines() if "Error" in line][-3:]
            raise SystemExit("vLLM failed: " + (" | ".join(tail) or run.stderr[-600:]))
        vllm = json.loads(result.read_text())
    m = vllm["metrics"]
    drafts, accepted = m["vllm:spec_decode_num_drafts"], m["vllm:spec_decode_num_accepted_tokens"]
    per_position = m.get("vllm:spec_decode_num_accepted_tokens_per_pos")
    same = sum(a == b for a, b in zip(kiln["plain"], vllm["tokens"], strict=True))
    header = (f"EAGLE-3 head of `{args.artifact}` beside dense `{target}`; {len(kiln['prompts'])} prompts of "
              f"{PROMPT_TOKENS} tokens, {args.new_tokens} new, EOS ignored, greedy, k={args.draft_tokens} (chain)")
    kiln_row = f"| Kiln runtime | {kiln['steps']} | {kiln['accepted']} of {kiln['drafted']} | {kiln['tau']:.3f} | - |"
    vllm_row = (f"| vLLM (CPU), eagle3 | {drafts:.0f} | {accepted:.0f} of {m['vllm:spec_decode_num_draft_tokens']:.0f} "
                f"| {1 + accepted / drafts:.3f} | {per_position} |")
    summary = (f"vLLM's speculative outputs equal Kiln's plain greedy decoding on {same}/{len(kiln['plain'])} prompts "
               f"(all {args.new_tokens} tokens); vLLM loaded in {vllm['load_seconds']:.0f} s and generated in "
               f"{vllm['generate_seconds']:.1f} s.")
    lines = [header, "", "| engine | verification steps | drafts accepted | acceptance length | by draft position |",
             "|---|---:|---:|---:|---|", kiln_row, vllm_row, "", summary]
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({
            "kiln": {k: kiln[k] for k in ("steps", "accepted", "drafted", "tau")},
            "vllm": {"steps": drafts, "accepted": accepted, "acceptance_length": 1 + accepted / drafts,
                     "per_position": per_position}, "identical": same, "prompts": len(kiln["plain"])}) + "\n")
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0 if same == len(kiln["plain"]) else 1


if __name__ == "__main__":
    sys.exit(main())
