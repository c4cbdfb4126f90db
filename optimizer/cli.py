"""The `optimize` command line: build, inspect, eval, generate, gate.

User errors print one line to stderr and exit 2; a gate below its floor (or --strict with a revert) exits 1.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kernels.errors import KilnError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Kiln: optimize a Hugging Face causal LM into an engine artifact for Hopper or Blackwell.")
# Tables stay readable when piped (rich would otherwise wrap them to 80 columns).
console = Console(stderr=True, width=None if sys.stderr.isatty() else 120)
out = Console(width=None if sys.stdout.isatty() else 120)


class GateFailed(Exception):
    """Exit 1: recovery below the floor."""


def _progress_factory(label: str):
    def make(total: int):
        progress = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=console, transient=True)
        state = {"task": None}

        def advance(n: int):
            if state["task"] is None:
                progress.start()
                state["task"] = progress.add_task(label, total=total)
            progress.advance(state["task"], n)
            if progress.tasks[0].completed >= total:
                progress.stop()
                progress.remove_task(state["task"])
                state["task"] = None
        return advance
    return make


def _gate_table(records_json: list[dict]) -> Table:
    table = Table(title="accuracy gate (through the runtime)")
    for col in ("pass", "decision", "baseline ppl", "ppl", "recovery", "pass recovery", "KL", "top-1", "floor"):
        table.add_column(col, justify="left" if col in ("pass", "decision") else "right")
    for p in records_json:
        g = p["gate"]
        if g is None:
            table.add_row(p["name"], p["decision"], *[""] * 7)
        else:
            table.add_row(p["name"], p["decision"], f"{g['baseline_perplexity']:.4f}", f"{g['perplexity']:.4f}",
                          f"{g['recovery']:.4f}", f"{g.get('pass_recovery', g['recovery']):.4f}", f"{g['kl']:.5f}",
                          f"{g['top1']:.4f}", f"{g['floor']}")
    return table


@app.command()
def build(
    checkpoint: Annotated[str | None, typer.Argument(help="HF checkpoint dir or hub id; default: embedded")] = None,
    target: Annotated[str, typer.Option(help="hopper or blackwell")] = "hopper",
    recipe: Annotated[str, typer.Option(help="built-in name, comma-separated names, or a YAML file")] = "fp8-weights",
    output: Annotated[Path, typer.Option("-o", "--output", help="artifact directory to write")] = Path("artifacts/out"),
    eval_data: Annotated[Path | None, typer.Option(help="held-out text for the gate")] = None,
    calib_data: Annotated[Path | None, typer.Option(help="calibration text")] = None,
    paragraphs: Annotated[int, typer.Option(help="paragraphs of eval data the gate scores")] = 600,
    min_recovery: Annotated[float | None, typer.Option(help="gate floor for every pass")] = None,
    strict: Annotated[bool, typer.Option(help="exit 1 if any pass is reverted")] = False,
    gate: Annotated[bool, typer.Option(help="run the accuracy gate after each pass")] = True,
    reproducible: Annotated[bool, typer.Option(help="leave timings out so rebuilds are byte-identical")] = False,
    overwrite: Annotated[bool, typer.Option(help="replace an existing output directory")] = False,
    trust_remote_code: Annotated[bool, typer.Option(help="allow a checkpoint's custom code")] = False,
    weight_bits: Annotated[float | None, typer.Option(help="auto recipe: effective bits per weight, scales "
                                                      "included (e.g. 5.0)")] = None,
    weight_bytes: Annotated[int | None, typer.Option(help="auto recipe: bytes of the quantizable linears' "
                                                     "weights and scales")] = None,
) -> None:
    """Optimize CHECKPOINT with RECIPE for TARGET and write an engine artifact."""
    from optimizer.build import build as run_build
    from optimizer.defaults import default_checkpoint, default_data
    from optimizer.report import human_bytes

    if checkpoint is None:
        path, message = default_checkpoint()
        console.print(f"[bold]{message}[/bold]")
        checkpoint = str(path)
    eval_data = eval_data or default_data("evaluation")
    calib_data = calib_data or default_data("calibration")
    result = run_build(checkpoint, target, recipe, output, eval_data=eval_data, calib_data=calib_data,
                       paragraphs=paragraphs, min_recovery=min_recovery, strict=strict, gate=gate,
                       reproducible=reproducible, overwrite=overwrite, trust_remote_code=trust_remote_code,
                       log=lambda m: console.print(f"[dim]{m}[/dim]"),
                       progress_factory=_progress_factory("scoring"), weight_bits=weight_bits,
                       weight_bytes=weight_bytes)
    manifest = result.manifest
    out.print(_gate_table(manifest["passes"]))
    if manifest.get("precision"):
        out.print(_precision_table(manifest["precision"]))
    src = manifest["sizes"]["source_weight_bytes"]
    sizes = Table(title="weights")
    for col in ("", "bytes", "human"):
        sizes.add_column(col, justify="right")
    sizes.add_row("source", str(src), human_bytes(src))
    sizes.add_row("artifact", str(result.weight_bytes), human_bytes(result.weight_bytes))
    sizes.add_row("ratio", f"{result.weight_bytes / src:.3f}", "")
    out.print(sizes)
    from optimizer.kv_report import kv_tables

    for kv_table in kv_tables(manifest["kv_budget"]):
        out.print(kv_table)
    out.print(f"wrote {result.path}")


def _precision_table(precision: dict) -> Table:
    """One row per layer group: the format the precision pass chose, its measured KL, and why."""
    table = Table(title=f"{precision['pass']}: {precision['effective_bits']:.3f} effective bits "
                        f"({precision['weight_bytes']} bytes for {precision['weights']} weights)")
    for col in ("group", "format", "KL", "why"):
        table.add_column(col, justify="right" if col == "KL" else "left", overflow="fold")
    for group, entry in precision["groups"].items():
        table.add_row(group, entry["option"], f"{entry['kl']:.2e}", entry["reason"])
    return table


def _module_bytes(manifest: dict) -> dict[str, int]:
    """Stored bytes per linear module (weights + scales), from the manifest's per-tensor table."""
    import torch

    sizes: dict[str, int] = {}
    for tensor, info in manifest.get("tensors", {}).items():
        module = tensor.rsplit(".", 1)[0]
        if module in manifest["formats"]:
            count = 1
            for dim in info["shape"]:
                count *= dim
            sizes[module] = sizes.get(module, 0) + count * getattr(torch, info["dtype"]).itemsize
    return sizes


@app.command()
def inspect(
    artifact: Annotated[Path, typer.Argument(help="artifact directory")],
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Per-layer formats, sizes and gate figures of an artifact."""
    from runtime.artifact import read_manifest

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
    }
    from optimizer.kv_report import artifact_kv_budget, kv_tables

    kv = artifact_kv_budget(artifact, manifest)
    summary["kv_bytes_per_token"] = kv["kv_bytes_per_token"]
    summary["source_kv_bytes_per_token"] = kv["source_kv_bytes_per_token"]
    summary["kv_cache"] = {k: v for k, v in kv.items() if not k.endswith("kv_bytes_per_token")}  # + concurrency
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    from optimizer.report import human_bytes

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
        out.print(_precision_table(manifest["precision"]))
    out.print(_gate_table(manifest["passes"]))
    w, s = summary["weight_bytes"], summary["source_weight_bytes"]
    out.print(f"weights: {human_bytes(w)} ({w} B) vs source {human_bytes(s)} ({s} B), ratio {w / s:.3f}")
    for kv_table in kv_tables(kv):
        out.print(kv_table)


def _score_artifact(artifact: Path, data: Path, paragraphs: int):
    import runtime
    from calibration.data import load_token_lists
    from optimizer.gate import score

    engine = runtime.load(artifact)
    tokens = load_token_lists(engine._tokenizer(), data, paragraphs)
    return engine, tokens, score(engine, tokens, _progress_factory("scoring")(len(tokens)))


@app.command("eval")
def eval_(
    artifact: Annotated[Path, typer.Argument(help="artifact directory")],
    data: Annotated[Path, typer.Option(help="text file (paragraphs separated by blank lines)")],
    paragraphs: Annotated[int, typer.Option(help="first N paragraphs")] = 600,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Perplexity of an artifact on a text file, through the runtime."""
    _, tokens, s = _score_artifact(artifact, data, paragraphs)
    result = {"perplexity": s.perplexity, "nll_per_token": s.nll / s.tokens, "tokens": s.tokens,
              "paragraphs": len(tokens)}
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        out.print(f"perplexity {s.perplexity:.4f} over {s.tokens} tokens ({len(tokens)} paragraphs)")


@app.command()
def generate(
    artifact: Annotated[Path, typer.Argument(help="artifact directory")],
    prompt: Annotated[list[str], typer.Argument(help="one or more prompts")],
    max_new_tokens: Annotated[int, typer.Option(help="tokens to generate")] = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    top_p: Annotated[float, typer.Option(help="nucleus sampling")] = 1.0,
    stop: Annotated[list[str] | None, typer.Option(help="stop string (repeatable)")] = None,
    seed: Annotated[int | None, typer.Option(help="sampling seed")] = None,
) -> None:
    """Generate text from an artifact with the slim runtime."""
    import runtime

    engine = runtime.load(artifact)
    for p, g in zip(prompt, engine.generate(prompt, max_new_tokens, temperature, top_p, stop, seed), strict=True):
        print(p + g.text)


@app.command()
def gate(
    artifact: Annotated[Path, typer.Argument(help="artifact directory")],
    baseline: Annotated[str, typer.Option(help="the source checkpoint")],
    data: Annotated[Path, typer.Option(help="held-out text")],
    min_recovery: Annotated[float, typer.Option(help="floor: ppl_baseline / ppl_artifact")],
    paragraphs: Annotated[int, typer.Option(help="first N paragraphs")] = 600,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """CI gate: exit 1 when the artifact's recovery against BASELINE falls below --min-recovery."""
    import runtime
    from calibration.data import load_token_lists
    from optimizer.gate import AccuracyGate, engine_from_graph
    from optimizer.loader import load_checkpoint

    engine = runtime.load(artifact)
    tokens = load_token_lists(engine._tokenizer(), data, paragraphs)
    progress = _progress_factory("scoring")
    checker = AccuracyGate(engine_from_graph(load_checkpoint(baseline)), tokens, progress(len(tokens)))
    result = checker.compare(engine, min_recovery)
    fields = {"recovery": result.recovery, "perplexity": result.perplexity,
              "baseline_perplexity": result.baseline_perplexity, "kl": result.kl, "top1": result.top1,
              "tokens": result.tokens, "min_recovery": min_recovery, "passed": result.passed}
    if as_json:
        print(json.dumps(fields, indent=2))
    else:
        table = Table(title="gate")
        for k in fields:
            table.add_column(k, justify="right")
        table.add_row(*[f"{v:.5f}" if isinstance(v, float) else str(v) for v in fields.values()])
        out.print(table)
    if not result.passed:
        raise GateFailed(f"recovery {result.recovery:.4f} is below the floor {min_recovery}")


@app.command("export")
def export_(
    artifact: Annotated[Path, typer.Argument(help="artifact directory")],
    fmt: Annotated[str, typer.Option("--format", help="hf-modelopt: ModelOpt's unified HF checkpoint "
                                     "(vLLM quantization='modelopt', SGLang, TensorRT-LLM)")] = "hf-modelopt",
    output: Annotated[Path, typer.Option("-o", "--output", help="directory to write")] = Path("artifacts/export"),
    overwrite: Annotated[bool, typer.Option(help="replace an existing output directory")] = False,
) -> None:
    """Export an artifact as a quantized Hugging Face checkpoint for the big serving engines."""
    from optimizer.export import HF_QUANT_CONFIG, export

    path = export(artifact, fmt, output, overwrite)
    algo = "none"
    if (path / HF_QUANT_CONFIG).is_file():
        algo = json.loads((path / HF_QUANT_CONFIG).read_text())["quantization"]["quant_algo"]
    out.print(f"wrote {path} ({fmt}, quant_algo {algo}); dequantized export matches the artifact")


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from optimizer.build import StrictRevert

    try:
        app(standalone_mode=False)
    except KilnError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except (GateFailed, StrictRevert) as exc:
        print(f"gate failed: {exc}", file=sys.stderr)
        sys.exit(1)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # click usage errors arrive here with standalone_mode=False
        import click

        if isinstance(exc, click.ClickException):
            print(f"error: {exc.format_message()}", file=sys.stderr)
            sys.exit(2)
        raise


if __name__ == "__main__":
    main()
