"""Weight precision: recovery, KL and top-1 vs effective bits of every format, auto, production and ModelOpt.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/precision.py [--checkpoint DIR] [--ood-data FILE]
        [--target blackwell] [--out artifacts/bench-precision] [--methods rtn,best] [--paragraphs 600]
    (run it with a Python that has nvidia-modelopt, e.g. the `anchors` extra, to add ModelOpt's rows)

Protocol (the gate's): calibrate on calibration.txt (observations on its first 256 paragraphs, end-to-end
tuning on all of it); score the first --paragraphs of evaluation.txt through Kiln's runtime (ModelOpt rows:
its fake-quantized Hugging Face model beside the unquantized one, on the same token lists). Each row reports,
against the fp32 source: recovery = ppl_fp32 / ppl, the mean per-token KL(fp32 || quantized) in nats over the
full vocabulary, and top-1 agreement (the fraction of positions whose argmax is the source's). With
--ood-data, every row is also scored the same way on all the paragraphs of that file (out of domain:
benchmarks/ood_text.py writes one). The checkpoint is stories260K unless --checkpoint names another. Every
row is built for --target (Blackwell) with the gate's floors off (recovery near 0, no KL ceiling, top-1 0), so
nothing backs off or reverts: the row is what the recipe itself reaches.
Effective bits = 8 x stored bytes (weights + scales, block padding included; BF16 = 16) / weights over the
decoder linears (the tied lm_head/embedding stays unquantized in every row and is left out). ModelOpt rows are
counted the same way from their formats (FP8: per-tensor scales; INT4 AWQ: 4 bits + an FP16 scale per 128
weights + an FP16 pre-quant scale per input channel). ModelOpt 0.47's NVFP4/MXFP4 fake quantization asserts
CUDA tensors, so on this CPU machine its rows are FP8 and INT4 AWQ, and auto_quantize searches those two (plus
BF16); its NVFP4 export is compared with Kiln's in tests/optimizer/test_export.py instead.
Each Kiln row is the built-in recipe of the row (`optimize build --recipe R`, "best": its calibration, e.g.
AWQ + GPTQ + end-to-end tuning; see optimizer/recipes.py) and the same recipe rounding to nearest ("rtn": no
GPTQ, AWQ or tuning; rotations and activation modes kept).
--external DIR[,LABEL] adds a row for a checkpoint quantized elsewhere (e.g. llm-compressor's GPTQ NVFP4A16,
benchmarks/llmcompressor_gptq.py): Kiln's loader decodes its pre-quantized linears to their float32 values
(optimizer/prequantized.py), the weights are scored as they are (no pass, no calibration), on the same token lists
and with the same gate as the other rows; its bits are counted from the tensors it stores (weights + scales of
each decoder linear), its build seconds are those of loading it.
Each row runs in its own process: build seconds include the gate's two scorings (ModelOpt rows: quantization
only); peak RAM is that process's max RSS through the build and the in-domain scoring (ModelOpt rows: both
Hugging Face models), before any OOD scoring, so it is the same with or without --ood-data.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kiln.optimizer.defaults import CALIBRATION_TEXT as CALIB
from kiln.optimizer.defaults import EVALUATION_TEXT as EVAL
from kiln.optimizer.defaults import STORIES260K as STORIES

# label -> (built-in recipe, weight bits for `auto`)
KILN_ROWS = {
    "FP8 W8A8": ("fp8", None),
    "FP8 W8A16": ("fp8-weights", None),
    "NVFP4 W4A16": ("nvfp4-w4a16", None),
    "NVFP4 W4A4": ("nvfp4", None),
    "MXFP4 W4A16": ("mxfp4-w4a16", None),
    "MXFP4 W4A4": ("mxfp4", None),
    "auto 4.5": ("auto", 4.5),
    "auto 5.0": ("auto", 5.0),
    "production": ("production", None),
}
MODELOPT_ROWS = {  # label -> ModelOpt config (auto_quantize: effective bits)
    "ModelOpt FP8_DEFAULT_CFG": ("FP8_DEFAULT_CFG",),
    "ModelOpt INT4_AWQ_CFG": ("INT4_AWQ_CFG",),
    "ModelOpt auto_quantize 4.5": ("auto", 4.5),
    "ModelOpt auto_quantize 5.0": ("auto", 5.0),
}


def has_modelopt() -> bool:
    import importlib.util

    return importlib.util.find_spec("modelopt") is not None


# --- one row, in its own process ---------------------------------------------------------------------------


def token_lists(tokenizer, path: Path, paragraphs: int) -> list[list[int]]:
    from kiln.calibration.data import load_token_lists

    return load_token_lists(tokenizer, path, paragraphs)


METHODS = ("rtn", "best")


def rtn_version(p):
    """The same pass rounding to nearest: no GPTQ, AWQ or tuning (rotations and activation modes stay)."""
    from dataclasses import replace

    from kiln.passes.weight_quant import WeightQuantization

    if isinstance(p, WeightQuantization):
        return replace(p, method="rtn", awq=False, tune_steps=0)
    return replace(p, method="rtn", tune_steps=0)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def figures(gate, prefix: str = "") -> dict:
    """A GateResult's figures against the source, keys prefixed (`ood_` for the out-of-domain text)."""
    return {f"{prefix}recovery": gate.recovery, f"{prefix}kl": gate.kl, f"{prefix}top1": gate.top1,
            f"{prefix}ppl": gate.perplexity, f"{prefix}baseline_ppl": gate.baseline_perplexity}


def kiln_row(label: str, method: str, paragraphs: int, checkpoint: Path, target: str,
             ood_data: Path | None) -> dict:
    import torch

    from kiln.optimizer.build import build
    from kiln.optimizer.recipes import Recipe, resolve_recipe

    torch.set_num_threads(1)
    name, bits = KILN_ROWS[label]
    recipe = resolve_recipe(name, weight_bits=bits)
    if method == "rtn":
        recipe = Recipe(f"{name} (rtn)", tuple(rtn_version(p) for p in recipe.passes))
    start = time.perf_counter()
    result = build(checkpoint, target, recipe, None, eval_data=EVAL, calib_data=CALIB, paragraphs=paragraphs,
                   gate=True, min_recovery=1e-6, max_kl=1e9, min_top1=0.0)  # every floor off: nothing reverts
    seconds = time.perf_counter() - start
    peak = peak_rss_mib()
    record = result.records[0]
    if record.decision != "kept":  # the figures below would be of the source, not of the recipe
        raise RuntimeError(f"{label} ({method}): the pass was {record.decision}, not kept")
    bits, formats = effective_bits(result.graph)
    row = {"label": label, "method": method, "recipe": name, **figures(record.gate), "bits": bits,
           "seconds": seconds, "peak_rss_mib": peak, "decision": record.decision, "formats": formats}
    if ood_data is not None:
        row.update(figures(kiln_ood(result.graph, checkpoint, ood_data), "ood_"))
    return row


def external_row(label: str, directory: Path, paragraphs: int, checkpoint: Path, ood_data: Path | None) -> dict:
    """A checkpoint quantized elsewhere, as Kiln's loader reads it (pre-quantized weights decoded to float32),
    against the fp32 source through the gate the built rows are scored by."""
    import torch

    from kiln.calibration.data import load_token_lists, token_cap
    from kiln.optimizer.loader import load_checkpoint
    from kiln.optimizer.measure.gate import AccuracyGate, engine_from_graph
    from kiln.runtime.engine import load_tokenizer

    torch.set_num_threads(1)
    start = time.perf_counter()
    graph = load_checkpoint(directory, log=lambda m: print(m, file=sys.stderr))
    seconds = time.perf_counter() - start
    source = load_checkpoint(checkpoint)
    cap = token_cap(source.spec.max_position_embeddings)
    tokens = load_token_lists(load_tokenizer(source.source.path), EVAL, paragraphs, cap)
    gate = AccuracyGate(engine_from_graph(source, onednn_head=False), tokens)  # as optimizer/build.py's gate
    prequantized = graph.metadata.get("loader", {}).get("prequantized", {})
    changed = sum(not torch.equal(graph.tensors[lin.weight_name], source.tensors[lin.weight_name])
                  for lin in graph.iter_linears() if lin.tied_to is None)
    row = {"label": label, "method": "external", "checkpoint": str(directory), **figures(gate(graph, 0.0)),
           "bits": stored_bits(graph, directory), "seconds": seconds, "peak_rss_mib": peak_rss_mib(),
           "decision": "", "formats": prequantized.get("schemes", {}), "linears_changed": changed}
    del gate
    if ood_data is not None:
        row.update(figures(kiln_ood(graph, checkpoint, ood_data), "ood_"))
    return row


def stored_bits(graph, directory: Path) -> float:
    """8 x the bytes a checkpoint stores for its decoder linears (every tensor of the linear's module but the
    bias: packed weights and their scales) / weights; a linear stored unquantized counts 16 bits, as in
    effective_bits."""
    from safetensors import safe_open

    sizes = {"U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "BF16": 2, "F16": 2, "F32": 4, "I32": 4}
    stored: dict[str, int] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle has keys() but no __iter__)
                piece = f.get_slice(name)
                stored[name] = math.prod(piece.get_shape()) * sizes[piece.get_dtype()]
    total, weights = 0, 0
    for lin in graph.iter_linears():
        if lin.role in ("lm_head", "router"):
            continue
        n = lin.out_features * lin.in_features
        weights += n
        mine = [k for k in stored if k.startswith(f"{lin.name}.") and k != f"{lin.name}.bias"]
        total += 2 * n if mine == [f"{lin.name}.weight"] else sum(stored[k] for k in mine)
    return 8 * total / weights


def kiln_ood(graph, checkpoint: Path, path: Path):
    """The built graph against its fp32 source on all the paragraphs of `path`, through Kiln's runtime."""
    from kiln.optimizer.loader import load_checkpoint
    from kiln.optimizer.measure.gate import AccuracyGate, engine_from_graph
    from kiln.runtime.engine import load_tokenizer

    source = load_checkpoint(checkpoint)
    lists = token_lists(load_tokenizer(source.source.path), path, None)
    return AccuracyGate(engine_from_graph(source), lists).compare(engine_from_graph(graph), 0.0)


def effective_bits(graph) -> tuple[float, dict[str, int]]:
    """8 x stored bytes / weights over the decoder linears (routers and the lm_head left out; BF16 = 16 bits),
    and how many linears each stored format has."""
    total, weights, formats = 0, 0, {}
    for lin in graph.iter_linears():
        if lin.role in ("lm_head", "router"):
            continue
        n = lin.out_features * lin.in_features
        weights += n
        if lin.quant is None:
            total += 2 * n
            kind = "bf16"
        else:
            total += sum(t.numel() * t.element_size() for t in lin.quant.tensors.values())
            act = lin.quant.activation
            kind = lin.quant.format + ("" if act == "none" else f" + {act} act")
        formats[kind] = formats.get(kind, 0) + 1
    return 8 * total / weights, formats


def _count(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def modelopt_row(label: str, paragraphs: int, checkpoint: Path, ood_data: Path | None,
                 calib_paragraphs: int = 256) -> dict:
    import modelopt.torch.quantization as mtq
    import torch

    from kiln.runtime.engine import load_tokenizer

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(checkpoint)
    calib = token_lists(tokenizer, CALIB, calib_paragraphs)
    evaluation = token_lists(tokenizer, EVAL, paragraphs)
    baseline = hf_model(checkpoint)  # the fp32 source, kept beside the model ModelOpt quantizes in place
    model = hf_model(checkpoint)

    def forward(m):
        with torch.no_grad():
            for ids in calib:
                m(torch.tensor([ids]))

    kind = MODELOPT_ROWS[label]
    start = time.perf_counter()
    if kind[0] == "auto":
        def loss(output, batch):
            return output.loss

        batches = [{"input_ids": torch.tensor([ids]), "labels": torch.tensor([ids])} for ids in calib[:128]]
        model, _ = mtq.auto_quantize(
            model, constraints={"effective_bits": kind[1]},
            quantization_formats=["INT4_AWQ_CFG", "FP8_DEFAULT_CFG"],  # its NVFP4 fake quant needs CUDA
            data_loader=batches, forward_step=lambda m, b: m(**b), loss_func=loss,
            num_calib_steps=len(batches), num_score_steps=len(batches), verbose=False)
    else:
        model = mtq.quantize(model, getattr(mtq, kind[0]), forward)
    seconds = time.perf_counter() - start
    row = {"label": label, "method": "modelopt", **figures(hf_compare(baseline, model, evaluation)),
           "bits": modelopt_bits(model), "seconds": seconds, "peak_rss_mib": peak_rss_mib(), "decision": "",
           "formats": {}, "calib_paragraphs": len(calib), "calib_tokens": sum(map(len, calib))}
    if ood_data is not None:
        row.update(figures(hf_compare(baseline, model, token_lists(tokenizer, ood_data, None)), "ood_"))
    return row


def hf_model(checkpoint: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def hf_compare(baseline, model, lists):
    """`model` against `baseline` as the gate compares them: NLL of both, KL(baseline || model) over the full
    vocabulary and top-1 agreement at every position, one paragraph's logits at a time."""
    import torch

    from kiln.calibration.metrics import kl_terms
    from kiln.passes.gate_result import GateResult

    nll, base_nll, kl, agree, count = 0.0, 0.0, 0.0, 0, 0
    with torch.no_grad():
        for ids in lists:
            inputs, targets = torch.tensor([ids]), torch.tensor(ids[1:])
            lp = torch.log_softmax(model(inputs).logits[0, :-1].float(), dim=-1)
            base = torch.log_softmax(baseline(inputs).logits[0, :-1].float(), dim=-1)
            nll -= float(lp.gather(1, targets[:, None]).sum())
            base_nll -= float(base.gather(1, targets[:, None]).sum())
            kl += float(kl_terms(base, lp).sum())
            agree += int((base.argmax(-1) == lp.argmax(-1)).sum())
            count += len(targets)
    return GateResult(perplexity=math.exp(nll / count), baseline_perplexity=math.exp(base_nll / count),
                      kl=kl / count, top1=agree / count, tokens=count, floor=0.0)


def modelopt_bits(model) -> float:
    """Effective bits of ModelOpt's quantized decoder linears, counted like Kiln's (see the module doc)."""
    import torch

    total_bits, weights = 0.0, 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or "lm_head" in name:
            continue
        n, k = module.weight.shape
        weights += n * k
        wq = getattr(module, "weight_quantizer", None)
        if wq is None or not wq.is_enabled:
            total_bits += 16 * n * k
            continue
        if wq.num_bits == (4, 3) and not wq.block_sizes:  # FP8, per-tensor (axis None) or per-channel (axis 0)
            total_bits += 8 * n * k + 32 * (n if wq.axis == 0 else 1)
            iq = getattr(module, "input_quantizer", None)
            total_bits += 32 if iq is not None and iq.is_enabled else 0
        elif wq.num_bits == 4:  # INT4 AWQ: FP16 scale per block, FP16 pre-quant scale per input channel
            block = wq.block_sizes[-1]
            total_bits += 4 * n * k + 16 * n * math.ceil(k / block) + 16 * k
        elif wq.num_bits == (2, 1):  # NVFP4: E4M3 scale per 16, FP32 global (+ input scale)
            padded = math.ceil(k / 16) * 16
            total_bits += 4 * n * padded + 8 * n * padded / 16 + 32
        else:
            raise ValueError(f"{name}: unknown ModelOpt weight format {wq.num_bits}")
    return total_bits / weights


def run_row(args) -> None:
    if args.method == "external":
        row = external_row(args.row, Path(args.external_dir), args.paragraphs, args.checkpoint, args.ood_data)
    elif args.row in MODELOPT_ROWS:
        row = modelopt_row(args.row, args.paragraphs, args.checkpoint, args.ood_data, args.modelopt_calib)
    else:
        row = kiln_row(args.row, args.method, args.paragraphs, args.checkpoint, args.target, args.ood_data)
    Path(args.json).write_text(json.dumps(row))


# --- the table and the plot ----------------------------------------------------------------------------------


ACCURACY = (("recovery", "recovery", ".4f"), ("KL", "kl", ".5f"), ("top-1", "top1", ".4f"))
"""(column, row key, format) of each accuracy figure; the OOD columns prefix both."""
COST = (("eff. bits", "bits", ".3f"), ("build s", "seconds", ".1f"), ("peak RAM MiB", "peak_rss_mib", ".0f"))


def table(rows: list[dict]) -> str:
    columns = list(ACCURACY)
    if any("ood_recovery" in r for r in rows):
        columns += [(f"OOD {name}", f"ood_{key}", spec) for name, key, spec in ACCURACY]
    columns += COST
    widths = [max(8, len(name)) for name, _, _ in columns]
    names = " | ".join(f"{name:>{w}s}" for (name, _, _), w in zip(columns, widths, strict=True))
    head = f"| {'row':27s} | {'method':8s} | {names} | notes |"
    lines = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for r in rows:
        notes = ", ".join(f"{n}x {o}" for o, n in sorted(r.get("formats", {}).items()))
        if r.get("recipe"):
            notes = f"--recipe {r['recipe']}: {notes}"
        if r.get("checkpoint"):
            notes = f"{r['checkpoint']}: {notes} ({r['linears_changed']} linears differ from the source)"
        if "calib_tokens" in r:
            notes = f"calibrated on {r['calib_paragraphs']} paragraphs ({r['calib_tokens']} tokens)"
        cells = [f"{r[key]:{w}{spec}}" if key in r else f"{'-':>{w}s}" for (_, key, spec), w in
                 zip(columns, widths, strict=True)]
        lines.append(f"| {r['label']:27s} | {r['method']:8s} | " + " | ".join(cells) + f" | {notes} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, model: str, target: str, paragraphs: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 5.5), dpi=110)
    style = {"rtn": ("o", "#1f77b4"), "best": ("D", "#9467bd"),
             "modelopt": ("^", "#d62728"), "external": ("s", "#2ca02c")}
    for method, (marker, color) in style.items():
        pts = [r for r in rows if r["method"] == method]
        if pts:
            name = {"modelopt": "ModelOpt", "external": "external"}.get(method, f"Kiln {method}")
            ax.scatter([r["bits"] for r in pts], [r["recovery"] for r in pts], marker=marker, color=color,
                       label=name, s=40, zorder=3)
            for r in pts:
                ax.annotate(r["label"].replace("ModelOpt ", ""), (r["bits"], r["recovery"]), fontsize=6,
                            xytext=(3, 2), textcoords="offset points")
    ax.axhline(0.985, color="grey", lw=0.8, ls="--")
    ax.axvline(5.0, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("effective bits per weight (scales included)")
    ax.set_ylabel(f"recovery = ppl_fp32 / ppl ({paragraphs} paragraphs of evaluation.txt)")
    ax.set_title(f"{model}: accuracy vs bits ({target} formats)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=STORIES, help="the fp32 source of every row")
    parser.add_argument("--target", default="blackwell", help="the target Kiln's rows are built for")
    parser.add_argument("--ood-data", type=Path, help="also score every row on all of this file's paragraphs")
    parser.add_argument("--out", type=Path, default=ROOT / "artifacts" / "bench-precision")
    parser.add_argument("--methods", default="rtn,best", help=f"Kiln calibration, comma-separated: {', '.join(METHODS)}")
    parser.add_argument("--rows", default="", help="only these rows (comma-separated labels)")
    parser.add_argument("--paragraphs", type=int, default=600)
    parser.add_argument("--modelopt-calib", type=int, default=256,
                        help="calibration paragraphs of the ModelOpt rows (its INT4_AWQ search on CPU costs about "
                             "0.4 s per SmolLM2 token: 256 paragraphs take hours there)")
    parser.add_argument("--jobs", type=int, default=1, help="rows run at once (one core each; times then contend)")
    parser.add_argument("--external", action="append", default=[], metavar="DIR[,LABEL]",
                        help="also score this pre-quantized checkpoint as it is (repeatable; --rows names it by LABEL)")
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--external-dir", help=argparse.SUPPRESS)
    parser.add_argument("--method", default="rtn", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row:
        run_row(args)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    wanted = [r.strip() for r in args.rows.split(",") if r.strip()]
    jobs = [(label, m) for label in KILN_ROWS for m in args.methods.split(",")]
    if has_modelopt():
        jobs += [(label, "modelopt") for label in MODELOPT_ROWS]
    else:
        print("nvidia-modelopt is not importable: no ModelOpt rows (install the `anchors` extra)", flush=True)
    externals = {}  # label -> directory
    for spec in args.external:
        directory, _, label = spec.partition(",")
        externals[label or Path(directory).name] = directory
    jobs += [(label, "external") for label in externals]
    jobs = [j for j in jobs if not wanted or j[0] in wanted]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

    def run(index: int) -> dict | None:
        label, method = jobs[index]
        out = args.out / f"row-{index}.json"
        cmd = [sys.executable, __file__, "--row", label, "--method", method, "--json", str(out),
               "--paragraphs", str(args.paragraphs), "--checkpoint", str(args.checkpoint),
               "--target", args.target, "--modelopt-calib", str(args.modelopt_calib)]
        if args.ood_data is not None:
            cmd += ["--ood-data", str(args.ood_data)]
        if method == "external":
            cmd += ["--external-dir", externals[label]]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(f"{label} [{method}] failed:\n{done.stderr[-2000:]}", flush=True)
            return None
        r = json.loads(out.read_text())
        ood = (f"  OOD {r['ood_recovery']:.4f} KL {r['ood_kl']:.5f} top-1 {r['ood_top1']:.4f}"
               if "ood_kl" in r else "")
        print(f"{label:27s} {method:8s} recovery {r['recovery']:.4f} KL {r['kl']:.5f} "
              f"top-1 {r['top1']:.4f}{ood}  "
              f"bits {r['bits']:.3f}  {r['seconds']:.1f} s  {r['peak_rss_mib']:.0f} MiB", flush=True)
        return r

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # each row is its own single-threaded process
        rows = [r for r in pool.map(run, range(len(jobs))) if r is not None]
    text = table(rows)
    print("\n" + text)
    (args.out / "precision.md").write_text(text + "\n")
    (args.out / "precision.json").write_text(json.dumps(rows, indent=2) + "\n")
    plot(rows, args.out / "precision.png", args.checkpoint.name, args.target, args.paragraphs)
    print(f"\nwrote {args.out / 'precision.md'}, {args.out / 'precision.png'}")


if __name__ == "__main__":
    main()
