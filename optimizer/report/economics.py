"""The economics report (`optimize report`, report.md's "Economics"): what a decoded token costs on each GPU, and
what each pass bought, priced against the honest baseline.

    $/Mtok = 277.78 x ($ per GPU-hour) / (tokens per second per GPU)        (277.78 = 10^6 / 3600)

Decode is a roofline over plain figures (bytes and FLOPs, no tensors), so an artifact's manifest and a Hugging
Face config with no weights go through the same arithmetic. One decode step of B sequences, each holding C tokens
of KV cache, takes max(memory time, compute time):

    memory  = (weight bytes read per step + B x KV bytes per sequence of C tokens) / HBM bandwidth
    compute = B x sum over GEMM precisions p of (2 x active params at p / dense peak FLOPs at p)
              + B x sum over layers of attention FLOPs per cached token x min(C, its window) / dense BF16 peak

KV bytes per sequence sum each layer's bytes per token times the tokens it keeps: the whole context, or its
sliding window (Gemma 3: 5 of every 6 layers keep 512 or 1024), as vLLM and SGLang free the blocks leaving it.

and yields B tokens (B x tau with speculation: the verification step reads and computes k + 1 tokens a sequence).

- Weight bytes in HBM: everything the model stores, BF16 (2 bytes a value) for all that is not quantized; a
  quantized linear's packed values and scales (FP8: 1 byte + an fp32 scale per output channel; NVFP4: half a
  byte + an E4M3 scale per 16 + an fp32 global scale; MXFP4: half a byte + an E8M0 scale per 32;
  MXFP6: three quarters of a byte + an E8M0 scale per 32).
- Weight bytes read per step: every linear of the decoder stack, the LM head and the norms; not the embedding
  table (one row a token) nor extra modules (MTP layers, draft heads: resident only). Of a MoE layer's routed
  experts, the fraction T tokens touch under uniform, independent routing: 1 - (1 - top_k / E)^T (top_k of E at
  batch 1, nearly all of them at large batches).
- GEMMs compute in the precision of their activations: weight-only formats dequantize to BF16; W8A8 FP8 runs on
  FP8 tensor cores; W4A4 FP4 on FP4 tensor cores where the GPU has them (Blackwell), weight-only on Hopper.
- Attention, in BF16 over the whole context: GQA/MHA 2 x heads x (head_dim + v_head_dim) FLOPs per cached token;
  MLA decodes absorbed over its latent, 2 x heads x (2 x kv_lora_rank + rope dim).
- The largest batch: `runtime.kv_budget.max_concurrent_sequences` at the decode context (10% of HBM reserved).
- Prefill of 1000 tokens, FLOP-bound: 2 x active params x 1000 + causal attention, heads x (qk dim + v dim) x
  n(n + 1) per layer.

The waterfall prices each pass on the same GPU at production concurrency (each step's own largest batch at the
decode context), in pipeline order: the source as served (BF16 weights and GEMMs, a paged BF16 KV cache of the
source's own GQA/MHA attention, no speculation; full attention on every layer) -> sliding windows (the source's
own, against full attention: applied only to a model that has them) -> MLA (against that paged GQA cache) -> weights FP8 (against
BF16) -> weights FP4 (and FP6: against FP8 on the same silicon) -> KV quantization (against a BF16 cache) -> speculation
(against none, at the max batch, where verifying k + 1 tokens a sequence can make the step compute-bound). Each
factor is the ratio of $/Mtok before and after its step; the factors multiply to the total. MLA comes first (the
issue lists it last) because it rewrites the linears the later steps quantize: the weight steps then price the
artifact's own linears and formats, with nothing guessed for linears the source had and the artifact has not.

With a workload (`--workload`), a serving section sizes co-located serving with chunked prefill against prefill and
decode pools on each GPU (serving_model), and the waterfall ends with its "disaggregation" step.

The pieces: figures.py (bytes and FLOPs), roofline.py (a decode step, $/Mtok), waterfall.py (the steps),
scenarios.py (an artifact or a config), prices.py (prices and capacity tiers), serving_model.py and
serving_section.py (the workload's deployments), economics_text.py and waterfall_plot.py (tables, report.md, the
PNG), report_output.py (`-o DIR`). This module assembles the report, and its names below are what `optimize report`
drives:

    scn = load_scenario(Path("ART"))
    report = economics_report(scn, parse_gpus("h100,b200"), parse_prices(None, ["h100", "b200"]))
    economics_markdown(report); economics_tables(report); write_report(report, Path("out"), "ART")
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict

from kiln.kernels.errors import KilnError
from kiln.optimizer.report.economics_text import economics_markdown
from kiln.optimizer.report.prices import (
    PRICE_NOTE,
    Tier,
    capacity_step,
    parse_prices,
    tier_rows,
)
from kiln.optimizer.report.roofline import GPUS, gpu_figures, replica
from kiln.optimizer.report.scenarios import manifest_scenario
from kiln.optimizer.report.serving_model import SERVING_ASSUMPTIONS, SERVING_NOT_MODELLED
from kiln.optimizer.report.serving_section import disaggregation_step, serving_section
from kiln.optimizer.report.waterfall import Scenario, price_steps
from kiln.optimizer.report.waterfall_plot import WATERFALL_PNG, waterfall_png
from kiln.optimizer.report.workload import DEFAULT_LINK_GBPS, link_bytes_per_second
from kiln.runtime.kv_budget import ACTIVATION_RESERVE_FRACTION
from kiln.runtime.spec import ModelSpec

DEFAULT_CONTEXT = 4096
NOT_MODELLED = (
    ("routing: which replica or model a request goes to, and MoE load imbalance (experts are taken as evenly "
     "loaded)"),
    "caching at the API layer: prompt and prefix caches, cached-token discounts",
    ("utilisation: a GPU is priced as busy 100% of the hour at the modelled batch; real fleets idle, and prefill "
     "takes a share of the time (the $/Mtok is decode only)"),
    "kernel efficiency: the roofline runs at peak bandwidth and peak dense FLOPs; real kernels reach less",
    "communication between GPUs (--gpus-per-replica adds up HBM, bandwidth and FLOPs as if free)",
)
ASSUMPTIONS = (
    "every sequence holds the decode context's worth of KV cache (conservative: real sequences grow into it)",
    "MoE: uniform, independent routing; T tokens of a step read 1 - (1 - top_k/E)^T of a layer's routed experts",
    "weights read per step: the decoder stack, LM head and norms, not the embedding table nor extra modules",
    ("GEMMs compute in their activations' precision (weight-only: BF16; FP4 W4A4 weight-only where there are no FP4 "
     "tensor cores); attention in BF16 over each layer's cached tokens (the context, or its sliding window)"),
    "prefill: FLOP-bound (the weights read once are not added; a short prompt on a large MoE can be memory-bound)",
    "speculation: the draft's own forward passes are not priced; tau = mean tokens a verification step yields",
)


def economics_report(scn: Scenario, gpus: Sequence[str] = tuple(GPUS), prices: Mapping | None = None,
                     context: int = DEFAULT_CONTEXT, gpus_per_replica: int = 1,
                     tiers: Mapping[str, Sequence[Tier]] | None = None, workload=None,
                     link_gbps: float | None = None) -> dict:
    """The report as JSON data: per GPU, the served model's figures and the waterfall; with a `workload`
    (workload.Workload), the serving section (co-located against disaggregated) and the waterfall's
    disaggregation step. `link_gbps`: the KV link, gigabits/s per GPU (default workload.DEFAULT_LINK_GBPS)."""
    if isinstance(context, bool) or not isinstance(context, int) or context <= 0:
        raise KilnError(f"--context must be a positive number of tokens, got {context!r}")
    if isinstance(gpus_per_replica, bool) or not isinstance(gpus_per_replica, int) or gpus_per_replica <= 0:
        raise KilnError(f"--gpus-per-replica must be a positive integer, got {gpus_per_replica!r}")
    prices = prices or parse_prices(None, gpus)
    served = scn.served
    if workload is None and link_gbps is not None:
        raise KilnError("--link-gbps prices the KV transfer of a --workload; give one")
    if workload is not None:
        link_gbps = DEFAULT_LINK_GBPS if link_gbps is None else link_gbps
        link = link_bytes_per_second(link_gbps)
    out = {
        "target": scn.name, "kind": scn.kind, "model_type": scn.model_type, "decode_context": context,
        "gpus_per_replica": gpus_per_replica,
        "formula": "usd_per_mtok = 277.78 x price_per_hour x gpus_per_replica / tokens_per_s",
        "price_note": PRICE_NOTE, "activation_reserve_fraction": ACTIVATION_RESERVE_FRACTION,
        "assumptions": [*scn.notes, *ASSUMPTIONS], "not_modelled": list(NOT_MODELLED),
        "mla_layers": list(scn.kv_layers), "gpus": {},
    }
    for key in gpus:
        device = replica(GPUS[key], gpus_per_replica)
        price, origin = prices[key]
        hourly = price * gpus_per_replica
        row = {"device": device.name, "price_per_hour": price, "price": origin,
               **gpu_figures(served.figures, device, hourly, context, served.speculation)}
        waterfall = price_steps(scn.steps, device, hourly, context)
        row["capacity_tiers"] = tier_rows((tiers or {}).get(key, ()), waterfall[-1], price)
        waterfall.append(capacity_step(row["capacity_tiers"], waterfall[-1]))
        if workload is not None:
            row["serving"] = serving_section(served.figures, device, hourly, workload, link)
            waterfall.append(disaggregation_step(row["serving"], waterfall[-1]))
        first, last = waterfall[0]["usd_per_mtok"], waterfall[-1]["usd_per_mtok"]
        row["waterfall"] = waterfall
        row["total_factor"] = first / last if first is not None and last is not None else None
        out["gpus"][key] = row
    if workload is not None:
        unit = "GPU" if gpus_per_replica == 1 else f"{gpus_per_replica}-GPU replica"
        out["serving"] = {"workload": {**asdict(workload), "describe": workload.describe()}, "unit": unit,
                          "link_gbps": link_gbps, "link_bytes_per_s": link,
                          "assumptions": list(SERVING_ASSUMPTIONS),
                          "not_modelled": list(SERVING_NOT_MODELLED)}
    return out


def build_economics(manifest: Mapping, spec: ModelSpec, source_spec: ModelSpec) -> tuple[list[str], dict[str, bytes]]:
    """What a build adds to its artifact: report.md's economics lines and the waterfall PNG, on every GPU of the
    table at default prices and the default decode context."""
    report = economics_report(manifest_scenario("this artifact", manifest, spec, source_spec))
    return economics_markdown(report), {WATERFALL_PNG: waterfall_png(report)}
