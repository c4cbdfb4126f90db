"""`optimize inspect` (what an artifact or an export holds) and `optimize report` (the economics: bytes,
concurrency, decode roofline, $/Mtok).

    optimize inspect ART [--json]
    optimize report ART --gpu h100,b200 [--workload chat]
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from kiln.kernels.errors import KilnError
from kiln.optimizer.cli.console import console, out
from kiln.optimizer.cli.options import DRAFT_TOKENS, GPUS_PER_REPLICA, TAU
from kiln.optimizer.cli.tables import gate_table, precision_table
from kiln.optimizer.report.artifact_report import human_bytes
from kiln.optimizer.report.kv_report import artifact_kv_budget, kv_tables

DTYPE_BYTES = {"float64": 8, "float32": 4, "int32": 4, "float16": 2, "bfloat16": 2, "int16": 2,
               "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e8m0fnu": 1, "uint8": 1, "int8": 1, "bool": 1,
               "int64": 8}
"""Bytes per element of the dtypes an artifact stores (inspect reads sizes without importing torch)."""


def _architecture_summary(arch: dict) -> dict:
    """The manifest's architecture (the spec the runtime executes), one entry per layer, without the rotary
    frequency tables."""
    def layer(entry: dict) -> dict:
        a, m = entry["attention"], entry["mlp"]
        out = {"index": entry["index"], "attention": a["kind"], "heads": a["num_heads"], "kv_heads": a["num_kv_heads"],
               "head_dim": a["head_dim"], "v_head_dim": a["v_head_dim"], "rotary_dim": a["rotary"]["dim"],
               "softmax_scale": a["softmax_scale"], "linears": sorted(a["linears"]), "mlp": m["kind"],
               "intermediate_size": m["intermediate_size"]}
        if a["kind"] == "mla":
            out.update(kv_lora_rank=a["kv_lora_rank"], q_lora_rank=a["q_lora_rank"],
                       qk_rope_head_dim=a["qk_rope_head_dim"], qk_nope_head_dim=a["qk_nope_head_dim"])
            if a["q_lora_rank"] is None:  # an MLA conversion: which engines' kernels take its cache width
                from kiln.optimizer.export.deepseek import serving_engines  # lazy: imports torch

                out["mla_kernels"] = serving_engines(a["kv_lora_rank"], a["qk_rope_head_dim"])
        if m["kind"] == "moe":
            out.update(experts=len(m["experts"]), top_k=m["top_k"], shared_experts=m["num_shared_experts"])
        return out

    return {"model_type": arch["model_type"], "hidden_size": arch["hidden_size"], "vocab_size": arch["vocab_size"],
            "tie_word_embeddings": arch["tie_word_embeddings"], "layers": [layer(e) for e in arch["layers"]],
            "extra_modules": [{"kind": e["kind"], "name": e["name"]} for e in arch["extra_modules"]]}


def _module_bytes(manifest: dict) -> dict[str, int]:
    """Stored bytes per linear module (weights + scales), from the manifest's per-tensor table."""
    sizes: dict[str, int] = {}
    for tensor, info in manifest.get("tensors", {}).items():
        module = tensor.rsplit(".", 1)[0]
        if module in manifest["formats"]:
            count = 1
            for dim in info["shape"]:
                count *= dim
            sizes[module] = sizes.get(module, 0) + count * DTYPE_BYTES.get(info["dtype"], 0)
    return sizes


def inspect(
    artifact: Annotated[Path, typer.Argument(help="artifact directory")],
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Per-layer formats, sizes and gate figures of an artifact; of an export: its layout and what loads it."""
    # lazy: kiln.runtime, and the export package's writers (torch), which --help never needs
    from kiln.optimizer.export.notes import describe_export
    from kiln.runtime.artifact import read_manifest

    if not (artifact / "manifest.json").is_file():
        export = describe_export(artifact)
        if export is not None:
            if as_json:
                print(json.dumps(export, indent=2))
            else:
                for line in (f"{artifact}: a Kiln export, format {export['format']} (from {export['artifact']})",
                             f"layout: {export['layout']}",
                             "loaders that read it: " + ("; ".join(export["loaders"]) or "unknown"),
                             f"config.json written for transformers {export['transformers_version']}"):
                    out.print(Text(line), soft_wrap=True)
            return
    manifest = read_manifest(artifact)
    layers = {name: e["format"] + (f"+{e['activation']}" if e.get("activation", "none") != "none" else "")
              for name, e in manifest["formats"].items()}
    layer_bytes = _module_bytes(manifest)
    summary = {
        "artifact": str(artifact), "schema_version": manifest["schema_version"], "target": manifest["target"],
        "recipe": manifest["recipe"]["name"], "source": manifest["source"],
        "weight_bytes": manifest["sizes"]["weight_bytes"],
        "source_weight_bytes": manifest["sizes"]["source_weight_bytes"],
        "layers": layers,
        "precision": (manifest.get("precision") or {}).get("linears", {}),  # linear -> group, option, why
        "layer_bytes": layer_bytes,
        "passes": [{"name": p["name"], "decision": p["decision"], "gate": p["gate"]} for p in manifest["passes"]],
        "architecture": _architecture_summary(manifest["architecture"]),
    }
    kv = manifest.get("kv_budget") or artifact_kv_budget(artifact, manifest)
    summary["kv_bytes_per_token"] = kv["kv_bytes_per_token"]
    summary["source_kv_bytes_per_token"] = kv["source_kv_bytes_per_token"]
    summary["kv_cache"] = {k: v for k, v in kv.items() if not k.endswith("kv_bytes_per_token")}  # + concurrency
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    table = Table(title=f"{artifact}: {manifest['source']['model_type']} for {manifest['target']}")
    table.add_column("module")
    table.add_column("role")
    table.add_column("format")
    table.add_column("method")
    table.add_column("bytes", justify="right")
    for name, e in manifest["formats"].items():
        shown = layers[name] + (f" (tied to {e['tied_to']})" if e.get("tied_to") else "")
        table.add_row(name, e.get("role", ""), shown, e.get("method", ""), str(layer_bytes.get(name, "")))
    out.print(table)
    if manifest.get("precision"):
        out.print(precision_table(manifest["precision"]))
    if manifest["passes"]:
        out.print(gate_table(manifest["passes"]))
    w, s = summary["weight_bytes"], summary["source_weight_bytes"]
    out.print(f"weights: {human_bytes(w)} ({w} B) vs source {human_bytes(s)} ({s} B), ratio {w / s:.3f}")
    for line in sorted({e["mla_kernels"] for e in summary["architecture"]["layers"] if "mla_kernels" in e}):
        out.print(f"MLA cache, {line}")
    for kv_table in kv_tables(kv):
        out.print(kv_table)


def report_(
    target: Annotated[Path, typer.Argument(help="artifact directory, or a Hugging Face config.json (or a directory "
                                          "holding one) for figures without weights")],
    gpu: Annotated[str, typer.Option("--gpu", help="GPUs to price, comma-separated: h100, h200, b200")] = \
        "h100,h200,b200",
    price_per_hour: Annotated[str | None, typer.Option(
        "--price-per-hour", help="$ per GPU-hour: one number for every GPU, pairs like h100=3.1,b200=6, or a tier "
        "table (YAML/JSON: on-demand, reserved, spot with interruptions; examples/prices/tiers.yaml) (default: "
        "neocloud on-demand rates, H100 $3.40)")] = None,
    context: Annotated[int, typer.Option(help="decode context: KV tokens each sequence holds")] = 4096,
    weights: Annotated[str | None, typer.Option(help="config only: assumed weights bf16, fp8 (W8A8) or nvfp4")] = None,
    kv: Annotated[str | None, typer.Option(help="config only: assumed KV cache bf16, fp8 or nvfp4")] = None,
    tau: Annotated[float | None, typer.Option(callback=TAU, help="speculation: mean tokens a verification step yields (overrides "
                                              "an artifact's recorded tau)")] = None,
    draft_tokens: Annotated[int, typer.Option(callback=DRAFT_TOKENS, help="speculation: draft tokens verified per step")] = 3,
    speculation: Annotated[Path | None, typer.Option(help="speculation measured under load (benchmarks/"
                                                     "speculative_serving.py --out FILE.json): its tau below the "
                                                     "break-even concurrency, off from there")] = None,
    gpus_per_replica: Annotated[int, typer.Option(callback=GPUS_PER_REPLICA, help="GPUs serving one copy of the model (their HBM, bandwidth "
                                                  "and FLOPs added up; price multiplied)")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="directory to write report.md and "
                                                "economics_waterfall.png into")] = None,
    workload: Annotated[str | None, typer.Option(
        help="serving section: chat (2048 in, 256 out, TTFT 1 s, TPOT 50 ms, 100 req/s), long-prompt (16384 in, "
        "128 out, TTFT 2 s, TPOT 50 ms, 20 req/s), or rate=R,prompt=P,output=O,ttft=S,tpot=S (req/s, tokens, "
        "seconds): co-located with chunked prefill against prefill and decode pools")] = None,
    rate: Annotated[float | None, typer.Option(help="serving: requests/s in all (replaces the workload's)")] = None,
    link_gbps: Annotated[float | None, typer.Option(
        "--link-gbps", help="serving: KV link between the pools, gigabits/s per GPU (default 400: one NDR "
        "InfiniBand NIC, 50 GB/s)")] = None,
) -> None:
    """Economics: weight and KV bytes, concurrency, decode roofline tokens/s and $/Mtok per GPU, and what each pass
    buys against its honest baseline; with --workload, co-located against disaggregated serving."""
    # lazy: the report's modules import torch, which --help never needs
    from kiln.optimizer.report.economics import economics_report
    from kiln.optimizer.report.economics_text import economics_tables, not_modelled_text
    from kiln.optimizer.report.prices import is_tier_table, load_tiers, parse_gpus, parse_prices
    from kiln.optimizer.report.report_output import check_report_output, write_report
    from kiln.optimizer.report.roofline import Speculation
    from kiln.optimizer.report.scenarios import load_scenario, load_speculation

    if output is not None:  # before any work: never an artifact, the input, or a directory of the user's
        check_report_output(output, target)
    gpus = parse_gpus(gpu)
    prices = parse_prices(price_per_hour, gpus)
    served = None
    if workload is not None:
        from kiln.optimizer.report.workload import parse_workload  # lazy: imports torch

        served = parse_workload(workload, rate)
    elif rate is not None:
        raise KilnError("--rate sets a --workload's arrival rate; give one (chat, long-prompt or rate=..,prompt=..)")
    if tau is not None and speculation is not None:
        raise KilnError("give --tau or --speculation, not both")
    speculation = (Speculation(tau, draft_tokens) if tau is not None
                   else load_speculation(speculation) if speculation is not None else None)
    scenario = load_scenario(target, weights, kv, speculation)
    tiers = load_tiers(price_per_hour, gpus) if is_tier_table(price_per_hour) else None
    report = economics_report(scenario, gpus, prices, context, gpus_per_replica, tiers, served, link_gbps)
    if output is not None:
        paths = write_report(report, output, target)
        console.print(f"wrote {', '.join(map(str, paths))}")
    if as_json:
        print(json.dumps(report, indent=2))
        return
    for table in economics_tables(report):
        out.print(table)
    out.print(not_modelled_text(report))
