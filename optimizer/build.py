"""The build driver: load -> check -> run the gated pipeline -> lower -> write the artifact."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kiln.calibration.data import (
    DEFAULT_PARAGRAPHS,
    load_token_lists,
    read_paragraphs,
    token_cap,
    tokenize_paragraphs,
    within_tokens,
)
from kiln.kernels.errors import BelowFloor, KilnError
from kiln.kernels.progress import stage
from kiln.kernels.targets import get_target
from kiln.optimizer.defaults import default_data
from kiln.optimizer.economics import build_economics
from kiln.optimizer.gate import AccuracyGate, check_floors, check_native_text, engine_from_graph
from kiln.optimizer.loader import load_checkpoint
from kiln.optimizer.lower import kv_cache_table, lower_tensors, tensor_bytes, write_artifact
from kiln.optimizer.numerics import warn_if_unpinned
from kiln.optimizer.output_dir import check_output
from kiln.optimizer.recipes import Recipe, resolve_recipe
from kiln.optimizer.report import calibration_summary, render_report
from kiln.optimizer.runner import RuntimeRunner
from kiln.optimizer.logit_kl import precision_files
from kiln.passes.base import PassContext, PassRecord, Pipeline
from kiln.passes.graph import ModelGraph
from kiln.passes.tensor_store import bound_heap
from kiln.runtime.artifact import sha256_file
from kiln.runtime.engine import load_tokenizer
from kiln.runtime.model_runner import resolve_placement
from kiln.runtime.kv_budget import kv_budget


class StrictRevert(BelowFloor):
    """--strict and a pass was reverted: exit 1, write nothing."""


def cpu_numerics() -> dict[str, str | None]:
    """The CPU code paths this process computes with (optimizer.cli.pin_cpu_numerics pins MKL's and OpenBLAS's):
    with the same versions, CPU and these, the recipes stored the same weights on one and two threads
    (stories260K); `threads` says which ran."""
    import torch

    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "mkl_cbwr": os.environ.get("MKL_CBWR"),
            "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"), "openblas_kernels": _openblas_kernels(),
            "threads": torch.get_num_threads(), "torch": torch.__version__}


def _openblas_kernels() -> list[str]:
    """The kernels each loaded OpenBLAS runs (scipy's, GPTQ's, loaded here if it was not): what ran, where the
    variable says what was asked (numpy's may have loaded before a Python caller pinned it)."""
    try:
        import scipy.linalg  # noqa: F401
        from threadpoolctl import threadpool_info
    except ImportError:
        return []
    return sorted({str(i.get("architecture")) for i in threadpool_info() if i.get("internal_api") == "openblas"})


@dataclass
class BuildResult:
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
        import resource
    except ImportError:  # not on this platform
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
    model's context (calibration.data.token_cap). Gate text the model cannot read (optimizer.gate.
    check_native_text) is refused unless `force`. `device` ("cuda"): the gate runs through the runtime on the
    GPU (what ships there: packed weights, bf16), and calibration's block forwards, K/V capture, sensitivity
    probes, Fisher sweeps and end-to-end tuning run there in fp32; the weight searches (GPTQ, AWQ, scale
    search) stay on the CPU, on the Hessians the observers keep there.
    """
    warn_if_unpinned()
    tgt = get_target(target)
    if isinstance(recipe, Recipe) and (weight_bits is not None or weight_bytes is not None):
        raise KilnError("weight_bits/weight_bytes configure the built-in 'auto' recipe; a Recipe object carries "
                        "its own passes (set the budget on its AutoPrecision pass)")
    if isinstance(recipe, Recipe) and (kv_fraction is not None or kv_bytes_per_token is not None):
        raise KilnError("kv_fraction/kv_bytes_per_token configure the built-in 'mla' recipe; a Recipe object "
                        "carries its own passes (set the budget on its MlaConversion pass)")
    rec = recipe if isinstance(recipe, Recipe) else resolve_recipe(recipe, weight_bits, weight_bytes,
                                                                    allow_custom_passes=allow_custom_passes,
                                                                    kv_fraction=kv_fraction,
                                                                    kv_bytes_per_token=kv_bytes_per_token)
    pipeline = Pipeline(rec.passes)  # ordering rules checked here, before anything loads
    check_floors(min_recovery, max_kl, min_top1)
    place, _, _ = resolve_placement(device, None, None)  # an unknown device, or cuda without a GPU: one line
    if place.type not in ("cpu", "cuda"):
        raise KilnError(f"a build runs on cpu or cuda, not {place.type}")
    if paragraphs <= 0 or calib_paragraphs <= 0:
        raise KilnError(f"paragraph counts must be positive, got {paragraphs} and {calib_paragraphs}")
    if calib_tokens is not None and calib_tokens <= 0:
        raise KilnError(f"calib_tokens (--calib-tokens) must be positive, got {calib_tokens}")
    if gate and eval_data is None:
        eval_data = default_data("evaluation")
    if calib_data is None:
        calib_data = default_data("calibration")
    inputs = [checkpoint, eval_data, calib_data, recipe if isinstance(recipe, str) else None]
    if output is not None:  # refuse an output we may not write before hours of work, not after
        check_output(output, overwrite, inputs)
    bound_heap()  # freed buffers go back to the system, so a block's peak does not grow along the model
    with stage("load checkpoint"):
        graph = load_checkpoint(checkpoint, trust_remote_code, log=log)
    if output is not None:
        inputs.append(graph.source.path)  # a hub id resolves to its snapshot directory
        check_output(output, overwrite, inputs)
    pipeline.check(graph, tgt)
    tokenizer = load_tokenizer(graph.source.path, trust_remote_code)
    cap = token_cap(graph.spec.max_position_embeddings)

    gate_fn = None
    eval_info = None
    if gate and pipeline.passes:
        tokens = load_token_lists(tokenizer, eval_data, paragraphs, cap, log=log)
        log(f"gate data: {len(tokens)} paragraphs of {eval_data}")
        progress = progress_factory(len(tokens)) if progress_factory else None
        with stage("gate baseline"):
            embedding = graph.tensors[graph.embedding]  # held first: the baseline and every candidate share it
            gate_fn = AccuracyGate(engine_from_graph(graph, device=place, onednn_head=False), tokens, progress,
                                   keep=(embedding,))
            del embedding
        check_native_text(gate_fn.baseline.perplexity, graph.spec.vocab_size, f"the gate text {Path(eval_data).name}",
                          force, log)
        eval_info = {"data": Path(eval_data).name, **data_file(eval_data), "paragraphs": len(tokens),
                     "paragraph_budget": paragraphs, "tokens": gate_fn.baseline.tokens,
                     "baseline_perplexity": round(gate_fn.baseline.perplexity, 6), "device": place.type}
    observation, tuning, calib_info = [], [], None
    if pipeline.passes:
        texts = read_paragraphs(calib_data, None)
        head = tokenize_paragraphs(tokenizer, texts[:calib_paragraphs], cap)
        rest = tokenize_paragraphs(tokenizer, texts[calib_paragraphs:], cap, required=False)
        observation = within_tokens(head, calib_tokens)
        # end-to-end tuning fits far more parameters than an observation: it gets every calibration paragraph
        tuning = within_tokens(head + rest, calib_tokens)
        calib_info = calibration_record(calib_data, observation, tuning, calib_tokens)
        log(f"calibration data: {calibration_summary(calib_info)} of {calib_data}")
    runner = RuntimeRunner(graph, observation, distillation_tokens=tuning, device=place) if observation else None
    ctx = PassContext(target=tgt, gate=gate_fn, floor=min_recovery, max_kl=max_kl, min_top1=min_top1, runner=runner,
                      log=log)

    source_spec = graph.spec  # the KV budget's "before" (a structural pass may rewrite the spec)
    start = time.perf_counter()
    with stage("passes"):
        records = pipeline.run(graph, ctx)
    build_seconds = time.perf_counter() - start
    reverted = [r.name for r in records if r.decision == "reverted"]
    if strict and reverted:
        raise StrictRevert(f"--strict: pass(es) {', '.join(reverted)} failed the gate and were reverted; "
                           "no artifact written")

    timings = not reproducible
    manifest = {
        "source": {"checkpoint": graph.source.name, "model_type": graph.model_type,
                   "weight_files": dict(graph.source.weight_files),
                   # the gate's baseline must match both (optimizer.gate.check_baseline)
                   **({"config_sha256": graph.source.config_sha256} if graph.source.config_sha256 else {})},
        "target": tgt.name,
        "recipe": {"name": rec.name, "passes": [r.config for r in records] if records else []},
        "passes": [r.to_json(timings) for r in records],
        "evaluation": eval_info,
        "calibration": calib_info,
        "build_seconds": round(build_seconds, 3) if timings else None,
        # the process's peak resident memory up to the passes' end (the artifact is then written tensor by tensor)
        "peak_rss_bytes": peak_rss_bytes() if timings else None,
        "reproducible": reproducible,
        # the thread count follows the machine's load when OMP_NUM_THREADS is unset, and the stored weights do not
        # depend on it: a reproducible build leaves it out, as it leaves out timings
        "numerics": {k: v for k, v in cpu_numerics().items() if not (reproducible and k == "threads")},
    }
    # every pass's record (what it leaves in graph.metadata), not only the precision pass's
    manifest["records"] = {key: value for key, value in sorted(graph.metadata.items()) if key != "precision"}
    if graph.metadata.get("precision"):
        manifest["precision"] = graph.metadata["precision"]
    tensors, formats = lower_tensors(graph)
    weight_bytes = tensor_bytes(tensors)
    kv_table = kv_cache_table(graph)
    manifest["kv_budget"] = kv_budget(graph.spec, kv_table, weight_bytes, graph.source.weight_bytes,
                                      source_spec=source_spec)
    manifest_preview = {**manifest, "formats": formats, "kv_cache": kv_table,
                        "sizes": {"weight_bytes": weight_bytes, "source_weight_bytes": graph.source.weight_bytes}}
    path = None
    if output is not None:
        with stage("write artifact"):
            economics, economics_files = build_economics(manifest_preview, graph.spec, source_spec)
            report = render_report(manifest_preview) + "\n" + "\n".join(economics) + "\n"
            path = write_artifact(graph, Path(output), manifest, report, overwrite,
                                  extra_files={**precision_files(manifest.get("precision")), **economics_files},
                                  inputs=inputs)
    return BuildResult(path, graph, records, manifest_preview, weight_bytes)
