"""`optimize build` (checkpoint -> artifact, each pass gated) and `optimize export` (artifact -> a Hugging Face
checkpoint for the big serving engines).

    optimize build CHECKPOINT --recipe fp8-weights -o ART
    optimize export ART --format compressed-tensors -o DIR
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from kiln.optimizer.cli.console import console, log, out
from kiln.optimizer.cli.options import (
    BUILD_DEVICE_HELP,
    CALIB_TOKENS,
    DATA_FORMATS,
    KV_BYTES,
    KV_FRACTION,
    PARAGRAPHS,
    WEIGHT_BITS,
    WEIGHT_BYTES,
)
from kiln.optimizer.cli.progress_view import timing_table
from kiln.optimizer.cli.tables import gate_table, precision_table
from kiln.optimizer.cli.threads import chosen_threads
from kiln.optimizer.report.artifact_report import embedding_lines, human_bytes
from kiln.optimizer.report.kv_report import kv_tables


def build(
    checkpoint: Annotated[str | None, typer.Argument(help="HF checkpoint dir or hub id; default: embedded")] = None,
    target: Annotated[str, typer.Option(help="hopper or blackwell")] = "hopper",
    recipe: Annotated[str, typer.Option(help="built-in name, comma-separated names, or a YAML file")] = "fp8-weights",
    output: Annotated[Path, typer.Option("-o", "--output", help="artifact directory to write")] = Path("artifacts/out"),
    eval_data: Annotated[Path | None, typer.Option(help=f"held-out data for the gate: {DATA_FORMATS}")] = None,
    calib_data: Annotated[Path | None, typer.Option(help=f"calibration data: {DATA_FORMATS}")] = None,
    calib_tokens: Annotated[int | None, typer.Option(callback=CALIB_TOKENS, help="calibrate on whole paragraphs, in file order, up to "
                                                     "this many tokens (default: 256 paragraphs to observe, all "
                                                     "to tune)")] = None,
    paragraphs: Annotated[int, typer.Option(callback=PARAGRAPHS, help="paragraphs of eval data the gate scores")] = 600,
    min_recovery: Annotated[float | None, typer.Option(help="gate floor for every pass")] = None,
    max_kl: Annotated[float | None, typer.Option(help="gate ceiling on the mean KL (nats/token) each pass adds, "
                                                 "for every pass")] = None,
    min_top1: Annotated[float | None, typer.Option(help="gate floor on top-1 agreement, for every pass")] = None,
    force: Annotated[bool, typer.Option(help="gate on text the model cannot read (baseline perplexity above "
                                        "1/8 of the vocabulary), with a warning")] = False,
    strict: Annotated[bool, typer.Option(help="exit 1 if any pass is reverted")] = False,
    gate: Annotated[bool, typer.Option(help="run the accuracy gate after each pass")] = True,
    reproducible: Annotated[bool, typer.Option(help="leave timings out so rebuilds are byte-identical")] = False,
    overwrite: Annotated[bool, typer.Option(help="replace an existing output directory")] = False,
    trust_remote_code: Annotated[bool, typer.Option(help="allow a checkpoint's custom code")] = False,
    allow_custom_passes: Annotated[bool, typer.Option(help="let a recipe file import its module:Class passes "
                                                      "(runs that code)")] = False,
    weight_bits: Annotated[float | None, typer.Option(callback=WEIGHT_BITS, help="auto recipe: effective bits per weight, scales "
                                                      "included (e.g. 5.0)")] = None,
    weight_bytes: Annotated[int | None, typer.Option(callback=WEIGHT_BYTES, help="auto recipe: bytes of the quantizable linears' "
                                                     "weights and scales")] = None,
    kv_fraction: Annotated[float | None, typer.Option(callback=KV_FRACTION, help="mla recipe: KV values per token kept, as a fraction "
                                                      "of the source's (e.g. 0.5)")] = None,
    kv_bytes_per_token: Annotated[int | None, typer.Option(callback=KV_BYTES, help="mla recipe: KV bytes per token, all layers, "
                                                           "with a BF16 cache")] = None,
    device: Annotated[str, typer.Option(help=BUILD_DEVICE_HELP)] = "cpu",
) -> None:
    """Optimize CHECKPOINT with RECIPE for TARGET and write an engine artifact."""
    # lazy: the build imports torch, the defaults tempfile; --help and inspect need neither
    from kiln.optimizer.build import build as run_build
    from kiln.optimizer.defaults import default_checkpoint, shared_dir

    count, why = chosen_threads()
    said = []

    def build_log(message: str) -> None:  # the build's first log line comes after the thread count
        if not said:  # (not before: a build refused at once still fails in one line)
            said.append(log(f"threads: {count} ({why})"))
        log(message)

    if checkpoint is None:
        path, message = default_checkpoint()
        console.print(f"[bold]{message}[/bold]")
        checkpoint = str(path)
        # the generated stand-in has random weights: every text is foreign to it, and its figures mean nothing
        force = force or shared_dir() is None
    result = run_build(checkpoint, target, recipe, output, eval_data=eval_data, calib_data=calib_data,
                       calib_tokens=calib_tokens,
                       paragraphs=paragraphs, min_recovery=min_recovery, strict=strict, gate=gate,
                       reproducible=reproducible, overwrite=overwrite, trust_remote_code=trust_remote_code,
                       allow_custom_passes=allow_custom_passes, log=build_log,
                       weight_bits=weight_bits,
                       weight_bytes=weight_bytes, max_kl=max_kl, min_top1=min_top1, force=force,
                       kv_fraction=kv_fraction, kv_bytes_per_token=kv_bytes_per_token, device=device)
    print_build_summary(result)


def print_build_summary(result) -> None:
    """What a finished build prints: gate and precision tables, weight sizes, the embedding, the KV budget, the
    time per stage and the peak RSS."""
    from kiln.optimizer.build import peak_rss_bytes  # lazy: imports torch (loaded by the build already)

    manifest = result.manifest
    if manifest["passes"]:
        out.print(gate_table(manifest["passes"]))
    if manifest.get("precision"):
        out.print(precision_table(manifest["precision"]))
    src = manifest["sizes"]["source_weight_bytes"]
    sizes = Table(title="weights")
    for col in ("", "bytes", "human"):
        sizes.add_column(col, justify="right")
    sizes.add_row("source", str(src), human_bytes(src))
    sizes.add_row("artifact", str(result.weight_bytes), human_bytes(result.weight_bytes))
    sizes.add_row("ratio", f"{result.weight_bytes / src:.3f}", "")
    out.print(sizes)
    for line in embedding_lines(manifest):
        out.print(Text(line), soft_wrap=True)
    for kv_table in kv_tables(manifest["kv_budget"]):
        out.print(kv_table)
    stages = timing_table()
    if stages is not None:
        console.print(stages)
    peak = peak_rss_bytes()
    if peak is not None:
        console.print(f"peak RSS: {peak / 1e9:.2f} GB (this process, the build and the gate)")
    out.print(f"wrote {result.path}")


def export_(
    artifact: Annotated[Path, typer.Argument(help="artifact directory")],
    fmt: Annotated[str, typer.Option("--format", help="compressed-tensors: llm-compressor's layout (vLLM, SGLang, "
                                     "transformers), which also takes FP8 weight-only and mixed per-layer formats; "
                                     "hf-modelopt: ModelOpt's unified HF checkpoint (vLLM quantization='modelopt', "
                                     "SGLang, TensorRT-LLM); hf: an MLA-converted model, unquantized, in "
                                     "DeepSeek-V3's layout; eagle3: the EAGLE-3 draft head for vLLM / "
                                     "SGLang; onnx: DIR/model.onnx, opset 23 with a KV cache, weights behind "
                                     "DequantizeLinear")] = "compressed-tensors",
    output: Annotated[Path, typer.Option("-o", "--output", help="directory to write")] = Path("artifacts/export"),
    overwrite: Annotated[bool, typer.Option(help="replace an earlier Kiln export there")] = False,
) -> None:
    """Export an artifact as a Hugging Face checkpoint for the big serving engines."""
    from kiln.optimizer.export import export, export_summary  # lazy: imports torch, which --help never needs

    out.print(export_summary(export(artifact, fmt, output, overwrite), fmt))
