"""The serving section of the economics report: one GPU's co-located and disaggregated deployments for a workload
(serving_model.py sizes them), the verdict, the waterfall's "disaggregation" step, and its tables.

    section = serving_section(figures, device, price_per_hour, parse_workload("chat"), link_bytes_per_second(400))
    section["winner"], section["verdict"]
    serving_markdown(report)                   # report.md lines of a report built with a workload
"""

from __future__ import annotations

from kiln.kernels.targets import Device
from kiln.optimizer.report.figures import ModelFigures
from kiln.optimizer.report.roofline import max_batch, usd_per_mtok
from kiln.optimizer.report.serving_model import (
    DEFAULT_BUDGET,
    Colocated,
    Disaggregated,
    RooflineCost,
    size_colocated,
    size_disaggregated,
)
from kiln.optimizer.report.workload import DEFAULT_LINK_GBPS, Workload, duration


def serving_section(figures: ModelFigures, device: Device, price_per_hour: float, w: Workload,
                    link: float = DEFAULT_LINK_GBPS * 1e9 / 8) -> dict:
    """One GPU's serving section: both deployments sized for `w`, goodput, $/Mtok and the verdict. `link`: bytes/s
    a GPU sends or receives KV at."""
    cost = RooflineCost(figures, device)
    sequences = max_batch(figures, device, w.prompt_tokens + w.output_tokens)
    kv_prompt = figures.kv_bytes(w.prompt_tokens)
    co = size_colocated(cost, w, sequences)
    dis = size_disaggregated(cost, w, sequences, kv_prompt, link, max_batch(figures, device, w.prompt_tokens) >= 1)

    def money(gpus: int | None) -> dict:
        if gpus is None:
            return {"goodput_per_gpu": None, "tokens_per_s_per_gpu": None, "usd_per_mtok": None}
        tokens = w.rate * w.output_tokens / gpus
        return {"goodput_per_gpu": w.rate / gpus, "tokens_per_s_per_gpu": tokens,
                "usd_per_mtok": usd_per_mtok(price_per_hour, tokens)}

    s = co.state
    colocated = {"gpus": co.gpus, "budget": s.budget if s else None, "chunk_tokens": s.chunk if s else None,
                 "ttft_s": s.ttft[0] if s else None, "tpot_s": s.tpot if s else None,
                 "slowest_iteration_s": s.slowest if s else None, "decode_rows_per_gpu": s.decode_rows if s else None,
                 "prefill_share": s.prefill_share if s else None, "bound": co.bound,
                 "capacity_per_gpu": co.capacity, **money(co.gpus)}
    p, d = dis.prefill, dis.decode
    disaggregated = {"gpus": dis.gpus, "prefill_gpus": dis.prefill_gpus, "decode_gpus": dis.decode_gpus,
                     "ttft_s": p.ttft if p else None, "tpot_s": d.tpot if d else None,
                     "kv_transfer_s": kv_prompt / link, "kv_bytes_per_prompt": kv_prompt,
                     "prefill_seconds": p.service if p else None, "prefill_utilisation": p.utilisation if p else None,
                     "decode_rows_per_gpu": d.decode_rows if d else None, "prefill_bound": dis.prefill_bound,
                     "decode_bound": dis.decode_bound, "capacity_per_gpu": dis.capacity,
                     "prefill_capacity_per_gpu": dis.prefill_capacity, "decode_capacity_per_gpu": dis.decode_capacity,
                     **money(dis.gpus)}
    winner, factor = _winner(co.gpus, dis.gpus)
    return {"max_sequences": sequences, "colocated": colocated, "disaggregated": disaggregated, "winner": winner,
            "factor": factor, "verdict": verdict(w, co, dis, winner, factor, kv_prompt / link)}


def _winner(co: int | None, dis: int | None) -> tuple[str | None, float | None]:
    """The deployment with fewer GPUs (co-located on a tie) and the factor co-located $/Mtok / the winner's (None
    where co-located meets the SLOs at no count)."""
    if co is None and dis is None:
        return None, 1.0
    if dis is None or (co is not None and co <= dis):
        return "co-located", 1.0
    return "disaggregated", (co / dis if co is not None else None)


def verdict(w: Workload, co: Colocated, dis: Disaggregated, winner: str | None, factor: float | None,
            transfer: float) -> str:
    """The verdict and why, in a few sentences."""
    if winner is None:
        return (f"Neither meets the SLOs. Co-located: {co.bound}. Disaggregated: prefill {dis.prefill_bound}; "
                f"decode {dis.decode_bound}.")
    if co.gpus is None:
        head = f"Disaggregated wins with {dis.gpus} GPUs: co-located has {co.bound}"
    elif dis.gpus is None:
        head = (f"Co-located wins with {co.gpus} GPUs: disaggregated has "
                + "; ".join(b for n, b in ((dis.prefill_gpus, dis.prefill_bound), (dis.decode_gpus, dis.decode_bound))
                            if n is None))
    else:
        tie = " (a tie goes to co-located: no KV transfer, one pool)" if co.gpus == dis.gpus else ""
        head = (f"{winner.capitalize()} wins: {co.gpus} co-located GPUs against {dis.gpus} disaggregated "
                f"({dis.prefill_gpus} prefill + {dis.decode_gpus} decode){tie}, factor x{factor:.2f}")
    parts = [head]
    if co.gpus is not None:
        s, d = co.state, co.default
        shrink = ""
        if s.budget != DEFAULT_BUDGET:
            shrink = (f"; at the default {DEFAULT_BUDGET}-token budget {', '.join(d.misses(w))}, so chunks shrink to "
                      f"{s.chunk} tokens")
        parts.append(f"Co-located: {s.decode_rows:.0f} decode rows a GPU ride along with prefill chunks that fill "
                     f"{s.prefill_share:.0%} of the time; TPOT {duration(s.tpot)} mean, {duration(s.slowest)} behind "
                     f"a chunk; TTFT {duration(s.ttft[0])}; bound: {co.bound}{shrink}")
    if dis.gpus is not None:
        parts.append(f"Disaggregated: the decode pool batches {dis.decode.decode_rows:.0f} rows a GPU at TPOT "
                     f"{duration(dis.decode.tpot)} (bound: {dis.decode_bound}); prefill GPUs "
                     f"{dis.prefill.utilisation:.0%} busy, a prompt in {duration(dis.prefill.service)} (bound: "
                     f"{dis.prefill_bound}); the KV transfer adds {duration(transfer)} to TTFT")
    parts.append(f"Unrounded, one GPU carries {co.capacity:.3g} req/s co-located and {dis.capacity:.3g} "
                 f"disaggregated (a prefill GPU {dis.prefill_capacity:.3g}, a decode GPU {dis.decode_capacity:.3g})")
    return ". ".join(parts) + "."


def disaggregation_step(section: dict | None, previous: dict) -> dict:
    """The waterfall's step after capacity: the better deployment for the workload against co-located with chunked
    prefill (factor 1 when co-located wins)."""
    row = {"step": "disaggregation", "label": "disaggregation", "against": "co-located, chunked prefill",
           "batch": previous["batch"], "tokens_per_s": previous["tokens_per_s"]}
    if section is None:
        return {**row, "applied": False, "factor": 1.0, "usd_per_mtok": previous["usd_per_mtok"],
                "note": "not applied: no --workload"}
    winner, factor = section["winner"], section["factor"]
    if winner != "disaggregated":
        why = "co-located wins" if winner else "neither deployment meets the SLOs"
        return {**row, "applied": False, "factor": 1.0, "usd_per_mtok": previous["usd_per_mtok"],
                "note": f"not applied: {why} for the workload (serving section)"}
    cost = previous["usd_per_mtok"]
    dis, co = section["disaggregated"], section["colocated"]
    if factor is None or cost is None:
        return {**row, "applied": True, "factor": None, "usd_per_mtok": cost,
                "note": f"disaggregated meets the SLOs with {dis['gpus']} GPUs; co-located with none"}
    return {**row, "applied": True, "factor": factor, "usd_per_mtok": cost / factor,
            "tokens_per_s": None if previous["tokens_per_s"] is None else previous["tokens_per_s"] * factor,
            "note": (f"{dis['prefill_gpus']} prefill + {dis['decode_gpus']} decode GPUs against {co['gpus']} "
                     "co-located for the workload: the ratio of their goodput $/Mtok")}


# --- rendering -------------------------------------------------------------------------------------------------------
SERVING_COLUMNS = ("GPU", "deployment", "GPUs (p+d)", "budget", "TTFT", "TPOT mean/max", "goodput/GPU",
                   "tok/s/GPU", "$/Mtok")


def serving_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    """The serving table: per GPU, co-located and disaggregated (cells "-" where no count meets the SLOs)."""
    unit = report["serving"]["unit"]
    head = [c.replace("GPU", unit) if c != "GPU" else c for c in SERVING_COLUMNS]
    rows = []
    for g in report["gpus"].values():
        s = g["serving"]
        for name, d in (("co-located", s["colocated"]), ("disaggregated", s["disaggregated"])):
            if d["gpus"] is None:
                rows.append([g["device"], name, "none meets the SLOs", *["-"] * 6])
                continue
            split = f" ({d['prefill_gpus']}+{d['decode_gpus']})" if name == "disaggregated" else ""
            behind = d["slowest_iteration_s"] if name == "co-located" else d["tpot_s"]
            chunk = str(d["budget"]) if name == "co-located" else f"{DEFAULT_BUDGET} alone"
            mark = " *" if s["winner"] == name else ""
            rows.append([g["device"], name + mark, f"{d['gpus']}{split}", chunk, duration(d["ttft_s"]),
                         f"{duration(d['tpot_s'])} / {duration(behind)}", f"{d['goodput_per_gpu']:.3g}",
                         f"{d['tokens_per_s_per_gpu']:,.0f}", f"{d['usd_per_mtok']:.3g}"])
    return head, rows


def serving_title(report: dict) -> str:
    s = report["serving"]
    return (f"serving {s['workload']['describe']}; KV link {s['link_gbps']:g} Gb/s per GPU "
            f"({s['link_bytes_per_s'] / 1e9:.3g} GB/s); * = the verdict")


def serving_markdown(report: dict) -> list[str]:
    """report.md's serving section."""
    s = report["serving"]
    head, rows = serving_rows(report)
    lines = ["", f"### Serving: {s['workload']['describe']}", "",
             (f"Co-located with chunked prefill against prefill and decode pools, each sized to meet its SLO "
              f"(TTFT: mean; TPOT: mean / the slowest iteration, which the SLO binds). Budget: tokens an iteration "
              f"runs. KV link {s['link_gbps']:g} Gb/s per GPU "
              f"({s['link_bytes_per_s'] / 1e9:.3g} GB/s). Goodput = requests/s per {s['unit']} within the SLOs; "
              "tokens/s and $/Mtok count output tokens. * = the verdict."), "",
             "| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += [""] + [f"- {g['device']}: {g['serving']['verdict']}" for g in report["gpus"].values()]
    lines += ["", "Serving model assumptions: " + "; ".join(s["assumptions"]) + ".",
              "", "Serving model, not modelled: " + "; ".join(s["not_modelled"]) + "."]
    return lines
