"""The build driver: load -> check -> run the gated pipeline -> lower -> write the artifact.

    result = build("../shared/models/stories260K", "hopper", "fp8-weights", Path("artifacts/s260k"))
    result = run_build(BuildConfig(checkpoint, "hopper", "fp8-weights", None, gate=False))  # the same, typed

`build()` is the Python API (its keyword arguments are `BuildConfig`'s fields); `run_build` runs a checked
`BuildConfig`. The graph is lowered once after the passes (optimizer.lower.lower): the manifest's preview, the
report and the artifact's files all come from that one lowering.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.calibration.data import (
    DEFAULT_PARAGRAPHS,
    load_token_lists,
    read_paragraphs,
    token_cap,
    tokenize_paragraphs,
    within_tokens,
)
from kiln.calibration.progress import stage
from kiln.optimizer.build_config import BuildConfig
from kiln.optimizer.errors import BelowFloor
from kiln.optimizer.loader import load_checkpoint
from kiln.optimizer.lower import Lowered, lower, write_artifact
from kiln.optimizer.measure.draft_resume import check_init_from
from kiln.optimizer.measure.gate import AccuracyGate, check_native_text, engine_from_graph
from kiln.optimizer.measure.logit_kl import precision_files
from kiln.optimizer.measure.runner import RuntimeRunner
from kiln.optimizer.numerics import warn_if_unpinned
from kiln.optimizer.output_dir import check_output
from kiln.optimizer.recipes import Recipe
from kiln.optimizer.report.artifact_report import calibration_summary, render_report
from kiln.optimizer.report.economics import build_economics
from kiln.passes.base import PassContext, PassRecord
from kiln.passes.graph import ModelGraph
from kiln.passes.tensor_store import bound_heap
from kiln.runtime.artifact import sha256_file
from kiln.runtime.engine import load_tokenizer
from kiln.runtime.kv_budget import kv_budget
from kiln.runtime.manifest import BuildRecord, Manifest, Source
from kiln.runtime.spec import ModelSpec


class StrictRevert(BelowFloor):
    """--strict and a pass was reverted: exit 1, write nothing."""


def cpu_numerics() -> dict[str, str | None]:
    """The CPU code paths this process computes with (optimizer.numerics.pin_cpu_numerics pins MKL's and OpenBLAS's):
    with the same versions, CPU and these, the recipes stored the same weights on one and two threads
    (stories260K); `threads` says which ran."""
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "mkl_cbwr": os.environ.get("MKL_CBWR"),
            "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"), "openblas_kernels": _openblas_kernels(),
            "threads": torch.get_num_threads(), "torch": torch.__version__}


def _openblas_kernels() -> list[str]:
    """The kernels each loaded OpenBLAS runs (scipy's, GPTQ's, loaded here if it was not): what ran, where the
    variable says what was asked (numpy's may have loaded before a Python caller pinned it)."""
    try:  # lazy: scipy and threadpoolctl are optional; importing scipy.linalg loads its OpenBLAS
        import scipy.linalg  # noqa: F401
        from threadpoolctl import threadpool_info
    except ImportError:
        return []
    return sorted({str(i.get("architecture")) for i in threadpool_info() if i.get("internal_api") == "openblas"})


@dataclass
class BuildResult:
    """The artifact's path (None: not written), the graph as the passes left it, their records, the manifest as
    written less the artifact's own tables (JSON data) and the stored tensors' bytes."""

    path: Path | None
    graph: ModelGraph
    records: list[PassRecord]
    manifest: dict
    weight_bytes: int


def data_file(path: Path | str) -> dict:
    """Which data file a build read: its path as given (so a reproducible rebuild repeats it) and its sha256."""
    return {"path": str(path), "sha256": sha256_file(Path(path))}


def calibration_record(path: Path | str, observation: list[list[int]], tuning: list[list[int]],
                       token_budget: int | None) -> dict:
    """manifest["calibration"]: the file, the token budget (None: none), and the token lists the passes got.
    `paragraphs` and `tokens` (every token, BOS included) count all of them: end-to-end tuning's set, whose first
    lists are observation's (also K/V capture's and sensitivity's). Where the two differ, each is stated."""
    def counts(lists):
        return {"paragraphs": len(lists), "tokens": sum(map(len, lists))}

    record = {**data_file(path), **counts(tuning), "token_budget": token_budget}
    if len(observation) != len(tuning):
        record |= {"observation": counts(observation), "tuning": counts(tuning)}
    return record


def peak_rss_bytes() -> int | None:
    """This process's peak resident memory so far (getrusage's ru_maxrss: KiB on Linux, bytes on macOS)."""
    try:
        import resource  # lazy: Unix only; elsewhere the peak is unknown
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def build(checkpoint: str | Path, target: str, recipe: str | Recipe, output: Path | None, *,
          eval_data: Path | None = None, calib_data: Path | None = None, paragraphs: int = DEFAULT_PARAGRAPHS,
          calib_paragraphs: int = 256, calib_tokens: int | None = None, min_recovery: float | None = None,
          strict: bool = False, gate: bool = True, reproducible: bool = False, overwrite: bool = False,
          trust_remote_code: bool = False, allow_custom_passes: bool = False,
          log: Callable[[str], None] = lambda m: None, progress_factory=None, weight_bits: float | None = None,
          weight_bytes: int | None = None, max_kl: float | None = None, min_top1: float | None = None,
          force: bool = False, kv_fraction: float | None = None, kv_bytes_per_token: int | None = None,
          device: str = "cpu") -> BuildResult:
    """Load CHECKPOINT, run RECIPE's gated passes for TARGET and write the artifact to OUTPUT (None: don't).

    The CLI and this function share every default: without `eval_data` / `calib_data` the gate and the
    calibration use the embedded texts (optimizer.defaults.default_data), as `optimize build` does.
    Observation, K/V capture and sensitivity use the first `calib_paragraphs` calibration paragraphs and
    end-to-end tuning all of them; `calib_tokens` bounds both (whole paragraphs in file order, at least one).
    `min_recovery`, `max_kl` and `min_top1` replace every pass's default floors. Paragraphs are cut at the
    model's context (calibration.data.token_cap). Gate text the model cannot read (optimizer.measure.gate.
    check_native_text) is refused unless `force`. `device` ("cuda"): the gate runs through the runtime on the
    GPU (what ships there: packed weights, bf16), and calibration's block forwards, K/V capture, sensitivity
    probes, Fisher sweeps and end-to-end tuning run there in fp32; the weight searches (GPTQ, AWQ, scale
    search) stay on the CPU, on the Hessians the observers keep there. `log` hears progress lines,
    `progress_factory(paragraphs)` makes the gate's progress display.
    """
    warn_if_unpinned()
    config = BuildConfig(
        checkpoint, target, recipe, output, eval_data=eval_data, calib_data=calib_data, paragraphs=paragraphs,
        calib_paragraphs=calib_paragraphs, calib_tokens=calib_tokens, min_recovery=min_recovery, max_kl=max_kl,
        min_top1=min_top1, strict=strict, gate=gate, reproducible=reproducible, overwrite=overwrite,
        trust_remote_code=trust_remote_code, allow_custom_passes=allow_custom_passes, force=force,
        weight_bits=weight_bits, weight_bytes=weight_bytes, kv_fraction=kv_fraction,
        kv_bytes_per_token=kv_bytes_per_token, device=device)
    return run_build(config, log, progress_factory)


def run_build(config: BuildConfig, log: Callable[[str], None] = lambda m: None, progress_factory=None
              ) -> BuildResult:
    """Run a checked build (see `build`): load, gate baseline, calibration text, passes, one lowering, write."""
    inputs = config.inputs
    if config.output is not None:  # refuse an output we may not write before hours of work, not after
        check_output(config.output, config.overwrite, inputs)
    bound_heap()  # freed buffers go back to the system, so a block's peak does not grow along the model
    with stage("load checkpoint"):
        graph = load_checkpoint(config.checkpoint, config.trust_remote_code, log=log)
    if config.output is not None:
        inputs.append(graph.source.path)  # a hub id resolves to its snapshot directory
        check_output(config.output, config.overwrite, inputs)
    config.pipeline.check(graph, config.target_spec)
    check_init_from(config.pipeline.passes, graph)
    tokenizer = load_tokenizer(graph.source.path, config.trust_remote_code)
    cap = token_cap(graph.spec.max_position_embeddings)
    gate_fn, eval_info = _gate(config, graph, tokenizer, cap, log, progress_factory)
    observation, tuning, calib_info = _calibration_tokens(config, tokenizer, cap, log)
    runner = RuntimeRunner(graph, observation, distillation_tokens=tuning, device=config.place) if observation \
        else None
    ctx = PassContext(target=config.target_spec, gate=gate_fn, floor=config.min_recovery, max_kl=config.max_kl,
                      min_top1=config.min_top1, runner=runner, log=log)

    source_spec = graph.spec  # the source's structure (a structural pass may rewrite the spec)
    start = time.perf_counter()
    with stage("passes"):
        records = config.pipeline.run(graph, ctx)
    build_seconds = time.perf_counter() - start
    reverted = [r.name for r in records if r.decision == "reverted"]
    if config.strict and reverted:
        raise StrictRevert(f"--strict: pass(es) {', '.join(reverted)} failed the gate and were reverted; "
                           "no artifact written")
    manifest = build_manifest(config, graph, records, eval_info, calib_info, build_seconds, source_spec)
    lowered = lower(graph)
    manifest = lowered.into(_with_kv_budget(manifest, graph, lowered, source_spec), graph)
    preview = manifest.to_json()
    path = None
    if config.output is not None:
        with stage("write artifact"):
            economics, economics_files = build_economics(preview, graph.spec, source_spec)
            report = render_report(preview) + "\n" + "\n".join(economics) + "\n"
            path = write_artifact(graph, Path(config.output), manifest, report, config.overwrite,
                                  extra_files={**precision_files(manifest.build.precision), **economics_files},
                                  inputs=inputs, lowered=lowered)
    return BuildResult(path, graph, records, preview, lowered.weight_bytes)


def _gate(config: BuildConfig, graph: ModelGraph, tokenizer, cap: int, log: Callable[[str], None],
          progress_factory) -> tuple[AccuracyGate | None, dict | None]:
    """The accuracy gate on the source graph and the manifest's "evaluation" record (None, None: no gate)."""
    if not (config.gate and config.pipeline.passes):
        return None, None
    eval_data = config.eval_data
    tokens = load_token_lists(tokenizer, eval_data, config.paragraphs, cap, log=log)
    log(f"gate data: {len(tokens)} paragraphs of {eval_data}")
    progress = progress_factory(len(tokens)) if progress_factory else None
    with stage("gate baseline"):
        embedding = graph.tensors[graph.embedding]  # held first: the baseline and every candidate share it
        gate_fn = AccuracyGate(engine_from_graph(graph, device=config.place, onednn_head=False), tokens, progress,
                               keep=(embedding,))
        del embedding
    check_native_text(gate_fn.baseline.perplexity, graph.spec.vocab_size, f"the gate text {Path(eval_data).name}",
                      config.force, log)
    eval_info = {"data": Path(eval_data).name, **data_file(eval_data), "paragraphs": len(tokens),
                 "paragraph_budget": config.paragraphs, "tokens": gate_fn.baseline.tokens,
                 "baseline_perplexity": round(gate_fn.baseline.perplexity, 6), "device": config.place.type}
    return gate_fn, eval_info


def _calibration_tokens(config: BuildConfig, tokenizer, cap: int, log: Callable[[str], None]
                        ) -> tuple[list[list[int]], list[list[int]], dict | None]:
    """(observation's token lists, end-to-end tuning's, the manifest's "calibration" record); none without passes."""
    if not config.pipeline.passes:
        return [], [], None
    texts = read_paragraphs(config.calib_data, None)
    head = tokenize_paragraphs(tokenizer, texts[:config.calib_paragraphs], cap)
    rest = tokenize_paragraphs(tokenizer, texts[config.calib_paragraphs:], cap, required=False)
    observation = within_tokens(head, config.calib_tokens)
    # end-to-end tuning fits far more parameters than an observation: it gets every calibration paragraph
    tuning = within_tokens(head + rest, config.calib_tokens)
    calib_info = calibration_record(config.calib_data, observation, tuning, config.calib_tokens)
    log(f"calibration data: {calibration_summary(calib_info)} of {config.calib_data}")
    return observation, tuning, calib_info


def build_manifest(config: BuildConfig, graph: ModelGraph, records: list[PassRecord], eval_info: dict | None,
                   calib_info: dict | None, build_seconds: float, source_spec: ModelSpec) -> Manifest:
    """The build's part of the manifest, once the passes ran (the lowering's and the artifact's come after)."""
    timings = not config.reproducible
    source = Source(checkpoint=graph.source.name, model_type=graph.model_type,
                    weight_files=dict(graph.source.weight_files),
                    # the gate's baseline must match both (optimizer.measure.gate.check_baseline)
                    config_sha256=graph.source.config_sha256 or None)
    record = BuildRecord(
        evaluation=eval_info, calibration=calib_info,
        build_seconds=round(build_seconds, 3) if timings else None,
        # the process's peak resident memory up to the passes' end (the artifact is then written tensor by tensor)
        peak_rss_bytes=peak_rss_bytes() if timings else None,
        reproducible=config.reproducible,
        # the thread count follows the machine's load when OMP_NUM_THREADS is unset, and the stored weights do not
        # depend on it: a reproducible build leaves it out, as it leaves out timings
        numerics={k: v for k, v in cpu_numerics().items() if not (config.reproducible and k == "threads")},
        # every pass's record (what it leaves in graph.metadata), not only the precision pass's
        records={key: value for key, value in sorted(graph.metadata.items()) if key != "precision"},
        precision=graph.metadata.get("precision") or None)
    rec = config.resolved_recipe
    return Manifest(source=source, target=config.target_spec.name,
                    recipe={"name": rec.name, "passes": [r.config for r in records] if records else []},
                    passes=[r.to_json(timings) for r in records], build=record, source_spec=source_spec)


def _with_kv_budget(manifest: Manifest, graph: ModelGraph, lowered: Lowered, source_spec: ModelSpec) -> Manifest:
    budget = kv_budget(graph.spec, lowered.kv_cache, lowered.weight_bytes, graph.source.weight_bytes,
                       source_spec=source_spec)
    return manifest.replace(build=dataclasses.replace(manifest.build, kv_budget=budget))
