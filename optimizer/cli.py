"""The `optimize` command line: build, inspect, eval, generate, serve, gate, export.

Exit codes are a promise to CI: 0 pass, 1 below a floor (or --strict met a reverted pass), 2 user error
(bad input, usage error), 130 interrupted (SIGINT), 143 terminated (SIGTERM). Every failure is one line on
stderr. Heavy libraries (torch, transformers) are imported inside the commands that need them, so
`--help` and `inspect` stay fast.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kiln.kernels import progress
from kiln.kernels.errors import BelowFloor, KilnError
from kiln.optimizer.progress_view import reporter_for, timing_table

# rich_markup_mode=None: click's plain help, which gives each option's names their own line when they are long;
# typer's rich panels cut long names at 80 columns (`--no-trust-remote…`) and show `<bool>` on every flag
# (tests/optimizer/test_help.py renders every command at 80 columns)
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Kiln: optimize a Hugging Face causal LM into an engine artifact for Hopper or Blackwell.")
# Tables stay readable when piped (rich would otherwise wrap them to 80 columns).
console = Console(stderr=True, width=None if sys.stderr.isatty() else 120)
out = Console(width=None if sys.stdout.isatty() else 120)
DATA_FORMATS = "a text file (paragraphs split at blank lines), or .jsonl/.json/.parquet (a 'text' field per record)"


MAX_MESSAGE = 300
"""Longest error line printed: a message built from hostile input must not flood a CI log."""
DEVICE_HELP = ("cpu: the fp32 reference, weights dequantized once; cuda: weights packed on the GPU (FP8 bytes, FP4 "
               "nibbles and their scales, through the Triton kernels), bf16 activations, KV cache and sampling "
               "on the GPU")
BUILD_DEVICE_HELP = ("where calibration runs (block forwards, K/V capture, sensitivity probes, tuning, in fp32) and "
                     "the gate: cpu (the fp32 reference) or cuda (the gate through the GPU runtime: packed weights, "
                     "bf16 activations); the weight searches (GPTQ, AWQ) run on the CPU either way")


from kiln.optimizer.numerics import CPU_NUMERICS, has_avx2, pin_cpu_numerics  # noqa: F401 (moved there: tests import them here)


def physical_cores(cpus: set[int] | None = None) -> int | None:
    """Distinct physical cores among `cpus` (logical CPU numbers; None: all), from /proc/cpuinfo's physical id and
    core id; None where it does not say (not Linux, or a VM that hides the topology)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    cores = set()
    for block in text.split("\n\n"):
        fields = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        if "processor" not in fields or "core id" not in fields:
            continue
        if cpus is None or int(fields["processor"]) in cpus:
            cores.add((fields.get("physical id", "0"), fields["core id"]))
    return len(cores) or None


def choose_threads() -> tuple[int, str]:
    """CPU threads for torch's (and MKL's, OpenBLAS's) parallel regions, and why.

    OMP_NUM_THREADS set: that, as the user asked. Otherwise the CPUs this process may run on (its affinity mask:
    a container's or taskset's limit), at most one per physical core (a second hyperthread adds nothing to
    GEMMs and costs a barrier), less the load other processes already put on them (the 1-minute load
    average): OpenMP threads wait for each other at every parallel region, so on cores that others are
    busy on, each region waits for the slowest, descheduled thread. README command 1 on a 2-core machine that
    other jobs kept busy took 60 s to gate with two threads and 5 s with one. The numbers do not depend on the
    choice (pin_cpu_numerics: the same weights on one and two threads)."""
    given = os.environ.get("OMP_NUM_THREADS", "").strip()
    if given:
        return (int(given) if given.isdigit() and int(given) > 0 else 1), "OMP_NUM_THREADS"
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        allowed = set(range(os.cpu_count() or 1))
    physical = physical_cores(allowed) or len(allowed)
    top = max(1, min(physical, len(allowed)))
    why = f"{len(allowed)} CPUs available, {physical} physical cores"
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return top, why
    free = int(len(allowed) - load + 0.5)
    if free < top:
        return max(1, free), f"{why}, load average {load:.1f}: busy"
    return top, f"{why}, load average {load:.1f}"


THREADS: tuple[int, str] | None = None
"""What use_threads chose for this process (the build's log line says it)."""


def use_threads() -> tuple[int, str]:
    """choose_threads, applied: OMP_NUM_THREADS for torch, MKL and OpenBLAS not yet started, and torch's own
    count when torch is imported already (an in-process caller)."""
    global THREADS
    count, why = choose_threads()
    os.environ.setdefault("OMP_NUM_THREADS", str(count))
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(count)
    THREADS = count, why
    return THREADS


class Interrupted(BaseException):
    """SIGINT or SIGTERM. A BaseException like KeyboardInterrupt, so it unwinds through every cleanup
    (temporary directories are removed), but not KeyboardInterrupt itself, which typer would swallow."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _on_signal(signum, frame):
    # a second Ctrl-C must not interrupt the cleanup of the first
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Interrupted(signum)


def _one_line(message: str) -> str:
    line = " ".join(str(message).split())
    return line if len(line) <= MAX_MESSAGE else line[: MAX_MESSAGE - 1] + "…"


MAX_SEED = 2**32 - 1
"""Largest seed an option takes: every generator Kiln seeds takes it (torch's, numpy's), and seed + i too."""
MAX_PARAGRAPHS = 1_000_000
"""Most paragraphs a command scores: far above any held-out set's, far below a run that never ends."""


def _bounded(flag: str, low: float | None = None, high: float | None = None, *, integer: bool = False,
             low_open: bool = False, why: str = ""):
    """A typer callback that refuses, while the command line is parsed (before any work), a numeric option
    outside its range: finite, within [low, high] (or (low, high] when `low_open`); `high` bounds an option
    whose cost grows with it, and `why` says what grows. One line naming the value and the range (exit 2);
    None (an option left unset) passes. Typer has already checked that an int option holds an integer."""
    def check(value):
        if value is None:
            return value
        ok = not isinstance(value, float) or math.isfinite(value)  # an int is compared as it is, however large
        ok = ok and (low is None or (value > low if low_open else value >= low)) and (high is None or value <= high)
        if not ok:
            kind = "an integer" if integer else "a finite number"
            if low is not None and high is not None:
                where = f"in {'(' if low_open else '['}{_num(low)}, {_num(high)}]"
            else:
                where = f"{'>' if low_open else '>='} {_num(low)}" if low is not None else f"<= {_num(high)}"
            raise KilnError(f"{flag} must be {kind} {where}{f' ({why})' if why else ''}, got {_num(value)}")
        return value
    return check


def _num(value: float) -> str:
    """An int as written (a seed of 2^32 - 1 is 4294967295, not 4.29497e+09), a float in its shortest form."""
    return str(value) if isinstance(value, int) else f"{value:g}"


# The numeric options' ranges, checked while the command line is parsed (report's --context and --price-per-hour
# are checked by optimizer.economics, the gate floors by optimizer.gate.check_floors, both before any work)
_PARAGRAPHS = _bounded("--paragraphs", 1, MAX_PARAGRAPHS, integer=True, why="each is scored")
_CALIB_TOKENS = _bounded("--calib-tokens", 1, integer=True)
_WEIGHT_BITS = _bounded("--weight-bits", 0, 16, low_open=True)
_WEIGHT_BYTES = _bounded("--weight-bytes", 1, integer=True)
_KV_FRACTION = _bounded("--kv-fraction", 0, 1, low_open=True)
_KV_BYTES = _bounded("--kv-bytes-per-token", 1, integer=True)
_DRAFT_TOKENS = _bounded("--draft-tokens", 1, 16, integer=True)
_TREE_WIDTH = _bounded("--tree-width", 1, 8, integer=True, why="1: a chain")
_MAX_NEW_TOKENS = _bounded("--max-new-tokens", 0, 1 << 20, integer=True, why="each is a decode step")
_TEMPERATURE = _bounded("--temperature", 0, why="0: greedy")
_TOP_P = _bounded("--top-p", 0, 1, low_open=True)
_SEED = _bounded("--seed", 0, MAX_SEED, integer=True)
_REPETITION_PENALTY = _bounded("--repetition-penalty", 0, low_open=True)
_PORT = _bounded("--port", 0, 65535, integer=True)
_MAX_QUEUE = _bounded("--max-queue", 1, 1 << 20, integer=True, why="each waiting request holds its prompt")
_MAX_NUM_SEQS = _bounded("--max-num-seqs", 1, 4096, integer=True, why="each holds KV cache blocks")
_MAX_BATCHED = _bounded("--max-num-batched-tokens", 1, 1 << 20, integer=True, why="a step's activations grow with it")
_REQUEST_TIMEOUT = _bounded("--request-timeout", 0, low_open=True)
_SLO = _bounded("--ttft-slo/--tpot-slo", 0, low_open=True)
_RESAMPLES = _bounded("--resamples", 1, 100_000, integer=True, why="the bootstrap's time and memory grow with it")
_GENERATE = _bounded("--generate", 0, 10_000, integer=True, why="each prompt is decoded by both models")
_GENERATE_TOKENS = _bounded("--generate-tokens", 1, 1 << 16, integer=True, why="each is a decode step of both models")
_TASK_LIMIT = _bounded("--task-limit", 1, integer=True)
_TAU = _bounded("--tau", 1)
_GPUS_PER_REPLICA = _bounded("--gpus-per-replica", 1, 1024, integer=True)


def _gate_table(records_json: list[dict]) -> Table:
    """One column per pass, one row per figure: stays whole in an 80-column terminal."""
    from kiln.optimizer.report import floor_cell

    table = Table(title="accuracy gate (through the runtime)")
    table.add_column("")
    for p in records_json:
        table.add_column(p["name"], justify="right", overflow="fold")
    rows = [("decision", lambda p, g: p["decision"]),
            ("baseline ppl", lambda p, g: f"{g['baseline_perplexity']:.4f}"),
            ("perplexity", lambda p, g: f"{g['perplexity']:.4f}"),
            ("recovery", lambda p, g: f"{g['recovery']:.4f}"),
            ("recovery 95% interval", lambda p, g: f"{g['recovery_low']:.4f}-{g['recovery_high']:.4f}"
             if "recovery_low" in g else ""),
            ("pass recovery", lambda p, g: f"{g.get('pass_recovery', g['recovery']):.4f}"),
            ("KL nats/token", lambda p, g: f"{g['kl']:.5f}"),
            ("pass KL", lambda p, g: f"{g.get('pass_kl', g['kl']):.5f}"),
            ("top-1 agreement", lambda p, g: f"{g['top1']:.4f}"),
            ("pass top-1", lambda p, g: f"{g.get('pass_top1', g['top1']):.4f}"),
            ("recovery floor", lambda p, g: floor_cell(g, "recovery", "≥", g["floor"])),
            ("KL ceiling", lambda p, g: floor_cell(g, "kl", "≤", g.get("max_kl"))),
            ("top-1 floor", lambda p, g: floor_cell(g, "top1", "≥", g.get("min_top1"))),
            ("suspect", lambda p, g: g.get("suspect", ""))]
    names = sorted({m["name"] for p in records_json if p["gate"] for m in p["gate"].get("metrics", ())})
    rows += [(name, lambda p, g, name=name: next((f"{m['value']:.4g} ({'pass' if m['passed'] else 'FAIL'})"
                                                  for m in g.get("metrics", ()) if m["name"] == name), ""))
             for name in names]
    gates = [p["gate"] for p in records_json if p["gate"]]
    # a pass that ran first costs what it measures: its pass KL and top-1 would repeat the rows above them
    relative = any(g.get("pass_kl", g["kl"]) != g["kl"] or g.get("pass_top1", g["top1"]) != g["top1"] for g in gates)
    for label, cell in rows:
        if label == "suspect" and not any(g.get("suspect") for g in gates):
            continue
        if label in ("pass KL", "pass top-1") and not relative:
            continue
        table.add_row(label, *[cell(p, p["gate"]) if p["gate"] or label == "decision" else ""
                               for p in records_json])
    return table


@app.command()
def build(
    checkpoint: Annotated[str | None, typer.Argument(help="HF checkpoint dir or hub id; default: embedded")] = None,
    target: Annotated[str, typer.Option(help="hopper or blackwell")] = "hopper",
    recipe: Annotated[str, typer.Option(help="built-in name, comma-separated names, or a YAML file")] = "fp8-weights",
    output: Annotated[Path, typer.Option("-o", "--output", help="artifact directory to write")] = Path("artifacts/out"),
    eval_data: Annotated[Path | None, typer.Option(help=f"held-out data for the gate: {DATA_FORMATS}")] = None,
    calib_data: Annotated[Path | None, typer.Option(help=f"calibration data: {DATA_FORMATS}")] = None,
    calib_tokens: Annotated[int | None, typer.Option(callback=_CALIB_TOKENS, help="calibrate on whole paragraphs, in file order, up to "
                                                     "this many tokens (default: 256 paragraphs to observe, all "
                                                     "to tune)")] = None,
    paragraphs: Annotated[int, typer.Option(callback=_PARAGRAPHS, help="paragraphs of eval data the gate scores")] = 600,
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
    weight_bits: Annotated[float | None, typer.Option(callback=_WEIGHT_BITS, help="auto recipe: effective bits per weight, scales "
                                                      "included (e.g. 5.0)")] = None,
    weight_bytes: Annotated[int | None, typer.Option(callback=_WEIGHT_BYTES, help="auto recipe: bytes of the quantizable linears' "
                                                     "weights and scales")] = None,
    kv_fraction: Annotated[float | None, typer.Option(callback=_KV_FRACTION, help="mla recipe: KV values per token kept, as a fraction "
                                                      "of the source's (e.g. 0.5)")] = None,
    kv_bytes_per_token: Annotated[int | None, typer.Option(callback=_KV_BYTES, help="mla recipe: KV bytes per token, all layers, "
                                                           "with a BF16 cache")] = None,
    device: Annotated[str, typer.Option(help=BUILD_DEVICE_HELP)] = "cpu",
) -> None:
    """Optimize CHECKPOINT with RECIPE for TARGET and write an engine artifact."""
    from kiln.optimizer.build import build as run_build
    from kiln.optimizer.defaults import default_checkpoint, shared_dir
    from kiln.optimizer.report import human_bytes

    count, why = THREADS or use_threads()
    said = []

    def log(message: str) -> None:  # the build's first log line comes after the thread count
        if not said:  # (not before: a build refused at once still fails in one line)
            said.append(_log(f"threads: {count} ({why})"))
        _log(message)

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
                       allow_custom_passes=allow_custom_passes, log=log,
                       weight_bits=weight_bits,
                       weight_bytes=weight_bytes, max_kl=max_kl, min_top1=min_top1, force=force,
                       kv_fraction=kv_fraction, kv_bytes_per_token=kv_bytes_per_token, device=device)
    manifest = result.manifest
    if manifest["passes"]:
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
    from kiln.optimizer.report import embedding_lines

    for line in embedding_lines(manifest):
        out.print(Text(line), soft_wrap=True)
    from kiln.optimizer.kv_report import kv_tables

    for kv_table in kv_tables(manifest["kv_budget"]):
        out.print(kv_table)
    stages = timing_table()
    if stages is not None:
        console.print(stages)
    from kiln.optimizer.build import peak_rss_bytes

    peak = peak_rss_bytes()
    if peak is not None:
        console.print(f"peak RSS: {peak / 1e9:.2f} GB (this process, the build and the gate)")
    out.print(f"wrote {result.path}")


def _log(message: str) -> None:
    # Text, not markup: a path or tensor name in brackets must print as written
    # soft_wrap: one message stays one line in a CI log, whatever the width, so `grep warning:` finds it whole
    console.print(Text(message, style="yellow" if message.startswith("warning:") else "dim"), soft_wrap=True)


def _precision_table(precision: dict) -> Table:
    """One row per layer group: the format the precision pass chose, its measured KL, and why."""
    table = Table(title=f"{precision['pass']}: {precision['effective_bits']:.3f} effective bits "
                        f"({precision['weight_bytes']} bytes for {precision['weights']} weights)")
    for col in ("group", "format", "KL", "why"):
        table.add_column(col, justify="right" if col == "KL" else "left", overflow="fold")
    for group, entry in precision["groups"].items():
        table.add_row(group, entry["option"], f"{entry['kl']:.2e}", entry["reason"])
    return table


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
                from kiln.optimizer.export.deepseek import serving_engines

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


@app.command()
def inspect(
    artifact: Annotated[Path, typer.Argument(help="artifact directory")],
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Per-layer formats, sizes and gate figures of an artifact; of an export: its layout and what loads it."""
    from kiln.runtime.artifact import read_manifest

    if not (artifact / "manifest.json").is_file():
        from kiln.optimizer.export.notes import describe_export

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
    from kiln.optimizer.kv_report import artifact_kv_budget, kv_tables

    kv = manifest.get("kv_budget") or artifact_kv_budget(artifact, manifest)
    summary["kv_bytes_per_token"] = kv["kv_bytes_per_token"]
    summary["source_kv_bytes_per_token"] = kv["source_kv_bytes_per_token"]
    summary["kv_cache"] = {k: v for k, v in kv.items() if not k.endswith("kv_bytes_per_token")}  # + concurrency
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    from kiln.optimizer.report import human_bytes

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
    if manifest["passes"]:
        out.print(_gate_table(manifest["passes"]))
    w, s = summary["weight_bytes"], summary["source_weight_bytes"]
    out.print(f"weights: {human_bytes(w)} ({w} B) vs source {human_bytes(s)} ({s} B), ratio {w / s:.3f}")
    for line in sorted({e["mla_kernels"] for e in summary["architecture"]["layers"] if "mla_kernels" in e}):
        out.print(f"MLA cache, {line}")
    for kv_table in kv_tables(kv):
        out.print(kv_table)


def _score_artifact(artifact: Path, data: Path, paragraphs: int, force: bool = False, device: str = "cpu"):
    """Score the artifact on `data`, paragraphs cut at its context; refuse text it cannot read unless `force`."""
    from kiln import runtime
    from kiln.calibration.data import load_token_lists, token_cap
    from kiln.optimizer.gate import check_native_text, score

    engine = runtime.load(artifact, device=device)
    tokens = load_token_lists(engine._tokenizer(), data, paragraphs, token_cap(engine.spec.max_position_embeddings),
                              log=_log)
    result = score(engine, tokens)
    check_native_text(result.perplexity, engine.spec.vocab_size, f"the text {data.name}", force, _log)
    return engine, tokens, result


@app.command("eval")
def eval_(
    artifact: Annotated[Path, typer.Argument(help="artifact directory")],
    data: Annotated[Path, typer.Option(help=DATA_FORMATS)],
    paragraphs: Annotated[int, typer.Option(callback=_PARAGRAPHS, help="first N paragraphs")] = 600,
    force: Annotated[bool, typer.Option(help="score text the model cannot read (perplexity above 1/8 of the "
                                        "vocabulary), with a warning")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    speculative: Annotated[bool, typer.Option(help="also decode each paragraph's first 16 tokens greedily for 64 "
                                              "tokens, with and without speculative decoding: tau, identical "
                                              "outputs, tokens/s")] = False,
    draft_tokens: Annotated[int, typer.Option(callback=_DRAFT_TOKENS, help="speculative: tokens drafted per target forward")] = 4,
    draft: Annotated[str, typer.Option(help="speculative drafter: auto, head, prompt-lookup")] = "auto",
    tree_width: Annotated[int | None, typer.Option(callback=_TREE_WIDTH, help="speculative, head: candidates per depth verified as a "
                                                   "tree (default: the artifact's; 1: a chain)")] = None,
    device: Annotated[str, typer.Option(help=DEVICE_HELP)] = "cpu",
) -> None:
    """Perplexity of an artifact on a text file, through the runtime, within the model's context."""
    engine, tokens, s = _score_artifact(artifact, data, paragraphs, force, device)
    result = {"perplexity": s.perplexity, "nll_per_token": s.nll / s.tokens, "tokens": s.tokens,
              "paragraphs": len(tokens)}
    if speculative:
        result.update(_speculative_eval(engine, tokens, draft, draft_tokens, tree_width))
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        out.print(f"perplexity {s.perplexity:.4f} over {s.tokens} tokens ({len(tokens)} paragraphs)")
        if speculative:
            out.print(f"speculative ({result['drafter']}, k={draft_tokens}): tau {result['tau']:.3f}, "
                      f"{result['identical']}/{result['prompts']} outputs identical to plain greedy decoding, "
                      f"{result['tokens_per_s']:.1f} vs {result['plain_tokens_per_s']:.1f} tokens/s")


SPECULATIVE_PROMPT_TOKENS, SPECULATIVE_NEW_TOKENS = 16, 64


def _speculative_eval(engine, tokens, draft: str, draft_tokens: int, tree_width: int | None = None) -> dict:
    """Greedy decoding of each paragraph's first 16 tokens, 64 new, plain and speculative, all prompts in one
    batch: tau, how many outputs are identical, and tokens/s of each."""
    import time

    prompts = [t[:SPECULATIVE_PROMPT_TOKENS] for t in tokens if len(t) >= SPECULATIVE_PROMPT_TOKENS]
    if not prompts:
        raise KilnError(f"--speculative needs paragraphs of at least {SPECULATIVE_PROMPT_TOKENS} tokens")
    drafter = engine.drafter(draft, tree_width=tree_width)
    start = time.perf_counter()
    plain = engine.generate_ids(prompts, SPECULATIVE_NEW_TOKENS, stop_ids=engine.spec.eos_token_ids)
    plain_seconds = time.perf_counter() - start
    start = time.perf_counter()
    spec, stats = engine.speculative_ids(prompts, SPECULATIVE_NEW_TOKENS, draft_tokens, drafter,
                                         stop_ids=engine.spec.eos_token_ids)
    spec_seconds = time.perf_counter() - start
    count = sum(len(o) for o, _ in plain)
    return {"drafter": type(drafter).__name__, "draft_tokens": draft_tokens,
            "tree_width": getattr(drafter, "tree_width", 1), "prompts": len(prompts),
            "identical": sum(a == b for a, b in zip(plain, spec, strict=True)), "tau": stats.tau,
            "acceptance": stats.acceptance, "tokens_per_s": sum(len(o) for o, _ in spec) / spec_seconds,
            "plain_tokens_per_s": count / plain_seconds}


@app.command()
def generate(
    artifact: Annotated[Path, typer.Argument(help="artifact directory")],
    prompt: Annotated[list[str], typer.Argument(help="one or more prompts")],
    max_new_tokens: Annotated[int, typer.Option(callback=_MAX_NEW_TOKENS, help="tokens to generate")] = 64,
    temperature: Annotated[float, typer.Option(callback=_TEMPERATURE, help="0 = greedy")] = 0.0,
    top_p: Annotated[float, typer.Option(callback=_TOP_P, help="nucleus sampling")] = 1.0,
    stop: Annotated[list[str] | None, typer.Option(help="stop string (repeatable)")] = None,
    seed: Annotated[int | None, typer.Option(callback=_SEED, help="sampling seed")] = None,
    repetition_penalty: Annotated[float | None, typer.Option(callback=_REPETITION_PENALTY, help="above 1 discourages repeats, below 1 "
                                                             "encourages them (default: the artifact's "
                                                             "generation_config.json, else 1)")] = None,
    speculative: Annotated[bool, typer.Option(help="speculative decoding: draft tokens, verify them in one "
                                              "target forward (greedy output is plain decoding's)")] = False,
    draft_tokens: Annotated[int, typer.Option(callback=_DRAFT_TOKENS, help="speculative: tokens drafted per target forward")] = 4,
    draft: Annotated[str, typer.Option(help="speculative drafter: auto (the artifact's draft head or MTP layer, "
                                       "else prompt-lookup), head, prompt-lookup")] = "auto",
    tree_width: Annotated[int | None, typer.Option(callback=_TREE_WIDTH, help="speculative, greedy, head: candidates per depth verified "
                                                   "as a tree (default: the artifact's; 1: a chain)")] = None,
    compile: Annotated[bool, typer.Option("--compile", help="torch.compile the decode step first (pays on long "
                                          "generations: compiling takes minutes; CUDA graphs on a GPU)")] = False,
    device: Annotated[str, typer.Option(help=DEVICE_HELP)] = "cpu",
) -> None:
    """Generate text from an artifact with the slim runtime."""
    from kiln import runtime

    engine = runtime.load(artifact, device=device)
    if compile:
        _log("compiling the decode step (torch.compile) ...")
        engine.compile_decode(mode="reduce-overhead" if engine.device.type == "cuda" else None)
    drafter = engine.drafter(draft, tree_width=tree_width) if speculative else None
    for p, g in zip(prompt, engine.generate(prompt, max_new_tokens, temperature, top_p, stop, seed,
                                            repetition_penalty, speculative, draft_tokens, drafter), strict=True):
        print(p + g.text)
    if speculative:
        stats = engine.last_speculative
        _log(f"speculative ({draft}): tau {stats.tau:.3f} tokens per target call over {stats.steps} verifications, "
             f"{stats.accepted} of {stats.drafted} drafts accepted")


@app.command()
def serve(
    artifact: Annotated[Path, typer.Argument(help="artifact directory")],
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(callback=_PORT, help="port to listen on (0: any free port)")] = 8000,
    max_queue: Annotated[int, typer.Option(callback=_MAX_QUEUE, help="requests waiting for a slot; beyond, 429")] = 256,
    max_num_seqs: Annotated[int, typer.Option(callback=_MAX_NUM_SEQS, help="requests decoding together")] = 32,
    max_num_batched_tokens: Annotated[int, typer.Option(callback=_MAX_BATCHED, help="tokens one step runs")] = 512,
    request_timeout: Annotated[float | None, typer.Option(callback=_REQUEST_TIMEOUT, help="abort a request after SEC seconds (504)")] = None,
    prefix_caching: Annotated[bool, typer.Option(help="reuse the KV blocks of shared prompt prefixes")] = True,
    served_model_name: Annotated[str | None, typer.Option(help="model id (default: the directory name)")] = None,
    compile: Annotated[bool, typer.Option("--compile", help="torch.compile the decode step before serving: "
                                          "faster steps, minutes of compiling at startup")] = False,
    device: Annotated[str, typer.Option(help=DEVICE_HELP)] = "cpu",
    ttft_slo: Annotated[float | None, typer.Option(callback=_SLO, help="SLO: seconds to the first token; "
                                                   "/metrics counts the requests that met it (kiln_slo_*)")] = None,
    tpot_slo: Annotated[float | None, typer.Option(callback=_SLO, help="SLO: seconds per output token after the "
                                                   "first (kiln_slo_*)")] = None,
    speculative: Annotated[bool, typer.Option(help="speculative decoding in the running batch: each step drafts "
                                              "for every decoding request and verifies in one target forward "
                                              "(greedy output unchanged; /metrics kiln_spec_decode_*)")] = False,
    draft: Annotated[str, typer.Option(help="speculative drafter: auto, head, prompt-lookup")] = "auto",
    draft_tokens: Annotated[int, typer.Option(callback=_DRAFT_TOKENS, help="speculative: tokens drafted per step")] = 4,
    tree_width: Annotated[int | None, typer.Option(callback=_TREE_WIDTH, help="speculative, head: candidates per "
                                                   "depth verified as a tree (default: the artifact's; 1: a chain)")] = None,
) -> None:
    """Serve an artifact over an OpenAI-compatible HTTP API (continuous batching); SIGTERM drains, then exits 0."""
    from kiln.runtime.server import ServerConfig
    from kiln.runtime.server import serve as run_server

    run_server(artifact, ServerConfig(host, port, max_queue, max_num_seqs, max_num_batched_tokens, request_timeout,
                                      prefix_caching, served_model_name, compile_decode=compile, device=device,
                                      ttft_slo=ttft_slo, tpot_slo=tpot_slo,
                                      speculative=draft if speculative else None, draft_tokens=draft_tokens,
                                      tree_width=tree_width))


@app.command()
def gate(
    artifact: Annotated[Path, typer.Argument(help="artifact directory")],
    baseline: Annotated[str, typer.Option(help="the checkpoint the artifact was built from")],
    data: Annotated[Path, typer.Option(help=f"held-out data: {DATA_FORMATS}")],
    min_recovery: Annotated[float, typer.Option(help="floor: ppl_baseline / ppl_artifact, in (0, 1.5]")],
    max_kl: Annotated[float | None, typer.Option(help="ceiling on the mean KL, nats/token (default: the sum of "
                                                 "the ceilings the artifact's passes were built to)")] = None,
    min_top1: Annotated[float | None, typer.Option(help="floor on top-1 agreement (default: 1 less the agreement "
                                                   "the artifact's passes were each allowed to lose)")] = None,
    paragraphs: Annotated[int, typer.Option(callback=_PARAGRAPHS, help="first N paragraphs")] = 600,
    decision: Annotated[str, typer.Option(help="point: the recovery figure must clear --min-recovery; lower: "
                                          "the lower end of its 95% interval must")] = "point",
    resamples: Annotated[int, typer.Option(callback=_RESAMPLES, help="bootstrap resamples for the recovery interval")] = 2000,
    seed: Annotated[int, typer.Option(callback=_SEED, help="bootstrap seed (the interval is deterministic for a seed)")] = 0,
    generate: Annotated[int, typer.Option(callback=_GENERATE, help="long-generation check: prompts (each paragraph's first 16 "
                                          "tokens) decoded greedily by both models; 0 skips it")] = 32,
    generate_tokens: Annotated[int, typer.Option(callback=_GENERATE_TOKENS, help="tokens each long generation decodes")] = 256,
    min_gen_agreement: Annotated[float | None, typer.Option(help="floor, each quarter of the generation: fraction "
                                                            "of the artifact's tokens the baseline would pick "
                                                            "(default 0.8)")] = None,
    min_distinct_ratio: Annotated[float | None, typer.Option(help="floor: the artifact's distinct-4 over the "
                                                             "baseline's; a loop repeats its 4-grams (default "
                                                             "0.75)")] = None,
    min_first_divergence: Annotated[float | None, typer.Option(help="floor: median token where the generations "
                                                               "first differ (default 4)")] = None,
    tasks: Annotated[Path | None, typer.Option(help="lm-eval task YAML (local tasks, a floor per task in its "
                                               "metadata) run on both models through the runtime")] = None,
    task_limit: Annotated[int | None, typer.Option(callback=_TASK_LIMIT, help="first N documents of each task")] = None,
    any_baseline: Annotated[bool, typer.Option(help="compare against BASELINE even when it is not the "
                                               "artifact's recorded source")] = False,
    force: Annotated[bool, typer.Option(help="score text the baseline cannot read (perplexity above 1/8 of "
                                        "the vocabulary), with a warning")] = False,
    fmt: Annotated[str, typer.Option("--format", help="text (tables), json, markdown or junit (XML, one test "
                                     "case per check), on stdout")] = "text",
    as_json: Annotated[bool, typer.Option("--json", help="same as --format json")] = False,
    junit: Annotated[Path | None, typer.Option(help="also write JUnit XML, one test case per check, to FILE")] = None,
    device: Annotated[str, typer.Option(help=DEVICE_HELP + "; the baseline runs there too")] = "cpu",
) -> None:
    """CI gate: exit 1 when a check fails (recovery, KL, top-1, long generation, tasks), 2 on bad input.

    Recovery comes with a 95% paired-bootstrap interval over the paragraphs; --decision lower holds its lower
    end to the floor."""
    from kiln.optimizer.gate import check_floors
    from kiln.optimizer.gate_report import FORMATS

    check_floors(min_recovery, max_kl, min_top1)
    fmt = "json" if as_json else fmt
    if fmt not in FORMATS:
        raise KilnError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if decision not in ("point", "lower"):
        raise KilnError(f"--decision must be point or lower, got {decision!r}")
    from kiln.optimizer.generation_check import GenerationFloors

    given = {"agreement": min_gen_agreement, "distinct4_ratio": min_distinct_ratio,
             "first_divergence": min_first_divergence}
    gen_floors = GenerationFloors(**{name: value for name, value in given.items() if value is not None})
    if tasks is not None and not tasks.is_file():
        raise KilnError(f"--tasks {tasks}: no such file")
    junit_inputs = [artifact, baseline, data, tasks]
    if junit is not None:  # before the gate runs, not after: never an input, a directory or the user's own file
        from kiln.optimizer.gate_report import is_kiln_junit
        from kiln.optimizer.output_dir import check_output_file

        check_output_file(junit, junit_inputs, is_kiln_junit, "--junit")
    import time

    started = time.perf_counter()
    from kiln import runtime
    from kiln.calibration.data import load_token_lists, token_cap
    from kiln.optimizer.gate import (
        AccuracyGate,
        Check,
        artifact_floors,
        check_baseline,
        check_native_text,
        engine_from_graph,
    )
    from kiln.optimizer.loader import load_checkpoint

    engine = runtime.load(artifact, device=device)
    source = load_checkpoint(baseline, log=_log)
    if not any_baseline:
        check_baseline(engine.manifest, source, log=_log)  # weights and config.json, each by sha256
    recorded_kl, recorded_top1 = artifact_floors(engine.manifest)
    max_kl = recorded_kl if max_kl is None else max_kl
    min_top1 = recorded_top1 if min_top1 is None else min_top1
    from kiln.runtime.engine import read_generation_defaults

    reference = engine_from_graph(source, engine.tokenizer, device=engine.device, dtype=engine.dtype)
    # the source decodes with its own generation defaults, as the artifact does with those it shipped
    reference.repetition_penalty = read_generation_defaults(source.source.path / "generation_config.json").get(
        "repetition_penalty", 1.0)
    if reference.spec.vocab_size != engine.spec.vocab_size:
        raise KilnError(f"baseline {baseline} has a vocabulary of {reference.spec.vocab_size} tokens, the artifact "
                        f"{engine.spec.vocab_size}: they are different models")
    context = min(reference.spec.max_position_embeddings, engine.spec.max_position_embeddings)
    tokens = load_token_lists(engine._tokenizer(), data, paragraphs, token_cap(context), log=_log)
    _log(f"scoring {len(tokens)} paragraphs of {data}: baseline, then artifact")
    checker = AccuracyGate(reference, tokens, resamples=resamples, seed=seed)
    check_native_text(checker.baseline.perplexity, reference.spec.vocab_size, f"the text {data.name}", force, _log)
    result = checker.compare(engine, min_recovery, max_kl, min_top1)
    low, high = result.recovery_interval
    checks = [Check("recovery" if decision == "point" else "recovery (95% lower bound)",
                    result.recovery if decision == "point" else low, min_recovery,
                    detail=f"point {result.recovery:.5f}, 95% interval [{low:.5f}, {high:.5f}]"),
              Check("KL (nats/token)", result.kl, max_kl, relation="<="),
              Check("top-1 agreement", result.top1, min_top1)]
    fields = {"recovery": result.recovery, "recovery_low": low, "recovery_high": high,
              "confidence": 0.95, "resamples": resamples, "seed": seed, "documents": len(tokens),
              "decision": decision, "perplexity": result.perplexity,
              "baseline_perplexity": result.baseline_perplexity, "kl": result.kl, "top1": result.top1,
              "tokens": result.tokens, "min_recovery": min_recovery, "max_kl": max_kl, "min_top1": min_top1,
              "suspect": result.suspect}
    if generate:
        from kiln.optimizer.generation_check import generation_prompts, long_generation

        _log(f"long generation: {generate} prompts x {generate_tokens} tokens, baseline and artifact")
        long = long_generation(engine, reference, generation_prompts(tokens, generate), generate_tokens)
        checks += long.checks(gen_floors)
        fields["generation"] = long.to_json()
    if tasks is not None:
        from kiln.optimizer.tasks import run_tasks

        task_checks, task_results = run_tasks(tasks, engine, reference, limit=task_limit, log=_log)
        checks += task_checks
        fields["tasks"] = task_results
    passed = all(c.passed for c in checks) and result.suspect is None
    fields.update(held={"recovery": checks[0].passed, "kl": checks[1].passed, "top1": checks[2].passed},
                  passed=passed, checks=[c.as_json() for c in checks])
    seconds = time.perf_counter() - started
    if junit is not None:
        from kiln.optimizer.gate_report import is_kiln_junit, junit_xml
        from kiln.optimizer.output_dir import atomic_file

        atomic_file(junit, junit_xml(checks, f"gate {artifact.name}", seconds, result.suspect), junit_inputs,
                    is_kiln_junit, "--junit")
    if fmt == "json":
        print(json.dumps(fields, indent=2))
    elif fmt == "junit":
        from kiln.optimizer.gate_report import junit_xml

        print(junit_xml(checks, f"gate {artifact.name}", seconds, result.suspect), end="")
    elif fmt == "markdown":
        from kiln.optimizer.gate_report import markdown

        print(markdown(fields, checks, f"Kiln gate: {artifact.name} against {baseline}"), end="")
    else:
        out.print(_checks_table(checks, f"gate: {artifact} against {baseline}", passed))
        out.print(f"recovery {result.recovery:.5f}, 95% interval [{low:.5f}, {high:.5f}] ({resamples} paired "
                  f"bootstrap resamples over {len(tokens)} paragraphs, seed {seed}); perplexity "
                  f"{result.perplexity:.5f} vs baseline {result.baseline_perplexity:.5f} over {result.tokens} tokens")
    if result.suspect:
        raise BelowFloor(f"implausible result, not a pass: {result.suspect}")
    failed = [c.failure for c in checks if not c.passed]
    if failed:
        raise BelowFloor(f"{len(failed)} of {len(checks)} checks failed: " + "; ".join(failed))


def _checks_table(checks, title: str, passed: bool) -> Table:
    table = Table(title=title)
    for col in ("check", "value", "floor", "result", "detail"):
        table.add_column(col, justify="right" if col in ("value", "floor") else "left", overflow="fold")
    for c in checks:
        table.add_row(c.name, f"{c.value:.5g}", f"{c.relation} {c.floor:g}", "pass" if c.passed else "FAILED",
                      c.detail)
    table.caption = "passed" if passed else "FAILED"
    return table


@app.command("export")
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
    from kiln.optimizer.export import export, export_summary

    out.print(export_summary(export(artifact, fmt, output, overwrite), fmt))


@app.command("report")
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
    tau: Annotated[float | None, typer.Option(callback=_TAU, help="speculation: mean tokens a verification step yields (overrides "
                                              "an artifact's recorded tau)")] = None,
    draft_tokens: Annotated[int, typer.Option(callback=_DRAFT_TOKENS, help="speculation: draft tokens verified per step")] = 3,
    speculation: Annotated[Path | None, typer.Option(help="speculation measured under load (benchmarks/"
                                                     "speculative_serving.py --out FILE.json): its tau below the "
                                                     "break-even concurrency, off from there")] = None,
    gpus_per_replica: Annotated[int, typer.Option(callback=_GPUS_PER_REPLICA, help="GPUs serving one copy of the model (their HBM, bandwidth "
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
    from kiln.optimizer import economics as econ

    if output is not None:  # before any work: never an artifact, the input, or a directory of the user's
        econ.check_report_output(output, target)
    gpus = econ.parse_gpus(gpu)
    prices = econ.parse_prices(price_per_hour, gpus)
    served = None
    if workload is not None:
        from kiln.optimizer.serving_model import parse_workload

        served = parse_workload(workload, rate)
    elif rate is not None:
        raise KilnError("--rate sets a --workload's arrival rate; give one (chat, long-prompt or rate=..,prompt=..)")
    if tau is not None and speculation is not None:
        raise KilnError("give --tau or --speculation, not both")
    speculation = (econ.Speculation(tau, draft_tokens) if tau is not None
                   else econ.load_speculation(speculation) if speculation is not None else None)
    scenario = econ.load_scenario(target, weights, kv, speculation)
    tiers = econ.load_tiers(price_per_hour, gpus) if econ.is_tier_table(price_per_hour) else None
    report = econ.economics_report(scenario, gpus, prices, context, gpus_per_replica, tiers, served, link_gbps)
    if output is not None:
        paths = econ.write_report(report, output, target)
        console.print(f"wrote {', '.join(map(str, paths))}")
    if as_json:
        print(json.dumps(report, indent=2))
        return
    for table in econ.economics_tables(report):
        out.print(table)
    out.print(econ.not_modelled_text(report))


def _click_exception_type() -> type[Exception]:
    # typer >= 0.29 vendors click as typer._click: find its ClickException through a public name
    return next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def _fail(code: int, message: str) -> None:
    print(_one_line(message), file=sys.stderr)
    sys.exit(code)


def _quiet_libraries() -> None:
    """Silence what is not the user's business: torchao's optional CUDA extensions failing to load on a CPU
    machine, and torch's deprecation notes about how torchao registers its enums."""
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    pin_cpu_numerics()  # before torch is imported by a command (they import it lazily)
    use_threads()  # likewise: OMP_NUM_THREADS is read when torch starts its thread pool
    _quiet_libraries()
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        with progress.reporting(reporter_for(console)):  # bars on a terminal, a line per stage otherwise
            code = app(standalone_mode=False)  # --help returns 0; a KeyboardInterrupt typer saw returns 130
    except Interrupted as exc:
        _fail(130 if exc.signum == signal.SIGINT else 143,
              f"{'interrupted' if exc.signum == signal.SIGINT else 'terminated'}: nothing was written")
    except KeyboardInterrupt:
        _fail(130, "interrupted: nothing was written")
    except KilnError as exc:
        _fail(2, f"error: {exc}")
    except BelowFloor as exc:
        _fail(1, f"gate failed: {exc}")
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        _fail(2, "error: aborted (no input)")
    except Exception as exc:
        if not isinstance(exc, _click_exception_type()):
            raise  # a bug: keep its traceback
        ctx = getattr(exc, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        # no arguments: click's NoArgsIsHelpError carries the whole help as its message (plain help mode)
        message = "" if type(exc).__name__ == "NoArgsIsHelpError" else exc.format_message()
        _fail(2, f"error: {message or 'no command given'}{hint}")
    if code == 130:
        _fail(130, "interrupted: nothing was written")
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
