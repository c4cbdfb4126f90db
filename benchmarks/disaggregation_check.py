"""The serving model's co-located case against Kiln's own scheduler on this CPU (issue #19, item 2).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/disaggregation_check.py ARTIFACT [--measure] [--rates 0.25,0.5,1,2,4]
        [--rate-seconds 40] [--measured FILE.json] [--out FILE.md]

1. Rates: this CPU described by measured rates instead of a datasheet. Through Kiln's scheduler (one thread, the
   server's step: the decode forward, the chunk forward, sampling and detokenizing), the seconds of a prefill step
   of one prompt of 16..512 tokens, and of a decode step of 1..16 rows; least squares fits: prefill a + b n +
   c n(n + 1) (the causal attention's pairs), decode a + b x rows: serving_model.MeasuredCost.
2. Prediction: serving_model.colocated_state with those rates, the server's settings (--max-num-seqs 16,
   --max-num-batched-tokens 512) and the workload of benchmarks/serve_load.py's open-loop sweep (its prompts,
   tokenized; output lengths as the server produced them, since EOS ends many before max_tokens), at each rate:
   TTFT p50 (the mix's median under the M/G/1 wait), TTFT mean, TPOT mean (each request's mean gap; its p50 over
   requests is the same to first order).
3. Measurement: `--measure` runs serve_load.py's open-loop sweep (one server, Poisson arrivals for --rate-seconds
   per rate, SLOs TTFT 1 s and TPOT 100 ms as benchmarks/results/serving_goodput.md, but prefix caching off unless
   --prefix-caching: the model has no cache, and the workload's prompts repeat paragraphs) and keeps each request's
   prompt, tokens, TTFT and TPOT, and the server's own mean TTFT and TPOT from /metrics, in --measured (default
   benchmarks/results/disaggregation_measured.json); without it the script reads that file. The rates are measured
   again after the sweep, and the prediction uses their mean (another job on the machine moves them).

Prints (and with --out writes) Markdown tables: the fitted rates, then per rate predicted against measured TTFT p50
and TPOT p50 and their ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch

from kiln.optimizer.report.serving_model import MeasuredCost, RequestClass, colocated_state, most

MEASURED = ROOT / "benchmarks" / "results" / "disaggregation_measured.json"
SERVER = {"max_num_seqs": 16, "max_num_batched_tokens": 512, "max_queue": 64, "ttft_slo": 1.0, "tpot_slo": 0.1}
PREFILL_TOKENS = (16, 32, 64, 128, 256, 512)
DECODE_ROWS = (1, 2, 4, 8, 16)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- 1. this CPU's rates ---------------------------------------------------------------------------------------------
def fit(points: list[tuple[float, float]], pairs: bool = False) -> list[float]:
    """Least squares a + b x (+ c x(x + 1))."""
    import numpy as np

    x = np.array([p[0] for p in points], dtype=float)
    columns = [np.ones_like(x), x] + ([x * (x + 1)] if pairs else [])
    return np.linalg.lstsq(np.stack(columns, 1), np.array([p[1] for p in points]), rcond=None)[0].tolist()


def measure_rates(artifact: Path, repeats: int = 5) -> dict:
    from kiln import runtime
    from kiln.runtime.request import SamplingParams
    from kiln.runtime.scheduler import Scheduler

    engine = runtime.load(artifact)
    vocab = engine.spec.vocab_size
    gen = torch.Generator().manual_seed(0)
    scheduler = Scheduler(engine, max_num_seqs=SERVER["max_num_seqs"],
                          max_num_batched_tokens=SERVER["max_num_batched_tokens"], prefix_caching=False)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    def timed_step() -> float:
        start = time.perf_counter()
        scheduler.step()
        return time.perf_counter() - start

    for _ in range(2):  # warm up both forwards
        scheduler.add_request(prompt(64), SamplingParams(max_tokens=4, stop_ids=()))
        while scheduler.has_work():
            scheduler.step()
    prefill = {}
    for n in PREFILL_TOKENS:
        times = []
        for _ in range(repeats):
            scheduler.add_request(prompt(n), SamplingParams(max_tokens=1, stop_ids=()))
            times.append(timed_step())  # the whole prompt in one chunk, then its first token
            while scheduler.has_work():
                scheduler.step()
        prefill[n] = statistics.median(times)
        log(f"prefill {n} tokens: {prefill[n] * 1e3:.1f} ms")
    decode = {}
    for rows in DECODE_ROWS:
        for _ in range(rows):
            scheduler.add_request(prompt(48), SamplingParams(max_tokens=10 + repeats * 3, stop_ids=()))
        while any(len(r.tokens) - r.num_computed > 1 for r in [*scheduler.running, *scheduler.waiting]) \
                or scheduler.queue_depth:
            scheduler.step()  # every prompt prefilled: the steps below are decode only
        decode[rows] = statistics.median(timed_step() for _ in range(repeats * 2))
        while scheduler.has_work():
            scheduler.step()
        log(f"decode {rows} rows: {decode[rows] * 1e3:.1f} ms")
    prefill, decode = {str(k): v for k, v in prefill.items()}, {str(k): v for k, v in decode.items()}
    return {"prefill_seconds": prefill, "decode_seconds": decode, "cost": fitted(prefill, decode),
            "kv_blocks": scheduler.cache.num_blocks, "block_size": scheduler.cache.block_size}


def fitted(prefill: dict[str, float], decode: dict[str, float]) -> dict[str, float]:
    a_p, b_p, c_p = fit([(int(k), v) for k, v in prefill.items()], pairs=True)
    a_d, b_d = fit([(int(k), v) for k, v in decode.items()])
    return {"decode_fixed": a_d, "decode_per_row": b_d, "prefill_fixed": a_p, "prefill_per_token": b_p,
            "prefill_per_pair": c_p}


# --- 3. the measurement ---------------------------------------------------------------------------------------------
def measure_sweep(artifact: Path, rates: list[float], seconds: float, prefix_caching: bool, seed: int = 0) -> dict:
    import serve_load as sl

    requests = sl.workload(4096, seed)
    flags = ["--max-queue", str(SERVER["max_queue"]), "--max-num-seqs", str(SERVER["max_num_seqs"]),
             "--max-num-batched-tokens", str(SERVER["max_num_batched_tokens"]), "--ttft-slo",
             str(SERVER["ttft_slo"]), "--tpot-slo", str(SERVER["tpot_slo"])] + ([] if prefix_caching
                                                                                else ["--no-prefix-caching"])
    server = sl.ServerProcess(artifact, flags, Path(tempfile.mkdtemp(prefix="kiln-disagg-check-")))
    out = []
    try:
        for i, rate in enumerate(rates):
            before = server.metrics()
            results, wall = asyncio.run(sl.open_loop_phase(server.url, requests, rate, seconds, seed + i))
            row = sl.rate_row(rate, results, wall, SERVER["ttft_slo"], SERVER["tpot_slo"])
            server.wait_idle(timeout=120)
            after = server.metrics()
            for name, metric in (("ttft", "kiln_time_to_first_token_seconds"),
                                 ("tpot", "kiln_time_per_output_token_seconds")):
                count = after[f"{metric}_count"] - before[f"{metric}_count"]
                row[f"server_{name}_mean_s"] = (after[f"{metric}_sum"] - before[f"{metric}_sum"]) / count \
                    if count else None
            row["requests"] = [{"index": j % len(requests), "status": r.status, "tokens": r.tokens, "ttft": r.ttft,
                                "tpot": r.tpot} for j, r in enumerate(results)]
            out.append(row)
            log(f"rate {rate:g}/s: {row['completed']}/{row['sent']} completed, TTFT p50 "
                f"{row['ttft_p50_s'] * 1e3:.0f} ms, TPOT p50 {row['tpot_p50_s'] * 1e3:.0f} ms")
    finally:
        server.stop()
    return {"rates": out, "seconds": seconds, "seed": seed, "server": {**SERVER, "prefix_caching": prefix_caching}}


# --- 2. the prediction ----------------------------------------------------------------------------------------------
def request_classes(artifact: Path, measured_row: dict, seed: int) -> tuple[list[RequestClass], list[int]]:
    """The sweep's requests at one rate as classes (prompt tokens, output tokens) with their shares: prompts
    tokenized as the server does, output lengths as the server produced them (completed requests)."""
    import serve_load as sl

    from kiln.runtime.engine import load_tokenizer

    tokenizer = load_tokenizer(artifact)
    requests = sl.workload(4096, seed)
    pairs = Counter()
    for r in measured_row["requests"]:
        if r["status"] == 200 and r["tokens"] >= 1:
            pairs[(len(tokenizer(requests[r["index"]]["prompt"])["input_ids"]), r["tokens"])] += 1
    total = sum(pairs.values())
    classes = [RequestClass(n / total, p, o) for (p, o), n in sorted(pairs.items())]
    return classes, [p for (p, _), n in pairs.items() for _ in range(n)]


def sequences_held(classes: list[RequestClass], blocks: int, block_size: int) -> float:
    """The running sequences the server holds: max_num_seqs, or fewer where the KV pool's blocks run out first
    (each sequence holding its prompt and output, as the GPU model counts)."""
    per_sequence = sum(c.share * math.ceil((c.prompt_tokens + c.output_tokens - 1) / block_size) for c in classes)
    return min(SERVER["max_num_seqs"], blocks / per_sequence)


def predict(cost: MeasuredCost, rate: float, classes: list[RequestClass], held: float) -> dict:
    s = colocated_state(cost, rate, classes, SERVER["max_num_batched_tokens"], held)
    if s.saturated:
        return {"saturated": s.saturated}
    return {"ttft_p50_s": s.ttft_quantile(classes, 0.5), "ttft_mean_s": s.ttft_mean(classes), "tpot_s": s.tpot,
            "decode_rows": s.decode_rows, "prefill_share": s.prefill_share}


# --- report ---------------------------------------------------------------------------------------------------------
def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def ratio(p: float | None, m: float | None) -> str:
    return "-" if p is None or not m else f"{p / m:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--measure", action="store_true", help="run serve_load's open-loop sweep (~4 min)")
    parser.add_argument("--rates", default="0.25,0.5,1,2,4")
    parser.add_argument("--rate-seconds", type=float, default=40)
    parser.add_argument("--measured", type=Path, default=MEASURED)
    parser.add_argument("--out", type=Path, help="write the Markdown tables here too")
    parser.add_argument("--prefix-caching", action="store_true", help="--measure: leave the server's prefix cache on")
    args = parser.parse_args()
    if not (args.artifact / "manifest.json").is_file():
        sys.exit(f"{args.artifact}: not an artifact directory (optimize build ... --recipe fp8-weights --no-gate)")
    torch.set_num_threads(1)
    random.seed(0)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=False).stdout.strip()
    if args.measure:
        before = measure_rates(args.artifact)
        load = os.getloadavg()[0]
        measured = measure_sweep(args.artifact, [float(r) for r in args.rates.split(",")], args.rate_seconds,
                                 args.prefix_caching)
        measured.update(load_average=[load, os.getloadavg()[0]], fitted=[before, measure_rates(args.artifact)],
                        commit=commit)
        args.measured.write_text(json.dumps(measured, indent=1) + "\n")
    elif not args.measured.is_file():
        sys.exit(f"{args.measured}: no measurement; run with --measure")
    else:
        measured = json.loads(args.measured.read_text())
    fits = measured["fitted"]
    # the mean of the steps measured before and after the sweep, fitted again
    rates = {kind: {k: statistics.fmean(f[kind][k] for f in fits) for k in fits[0][kind]}
             for kind in ("prefill_seconds", "decode_seconds")}
    rates["cost"] = fitted(rates["prefill_seconds"], rates["decode_seconds"])
    cost = MeasuredCost(**rates["cost"])
    c = rates["cost"]
    blocks, block_size = fits[0]["kv_blocks"], fits[0]["block_size"]

    machine = (f"Measured at commit {measured.get('commit', '?')}, rendered at {commit}; "
               f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
               f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')}, torch threads {torch.get_num_threads()}.")
    fit_line = (f"Fit: prefill step = {c['prefill_fixed'] * 1e3:.2f} ms + {c['prefill_per_token'] * 1e3:.3f} ms x n + "
              f"{c['prefill_per_pair'] * 1e6:.3f} us x n(n + 1); decode step = {c['decode_fixed'] * 1e3:.2f} ms + "
              f"{c['decode_per_row'] * 1e3:.2f} ms x rows.")
    if "load_average" in measured:
        machine += (f" Load average (1 min) {measured['load_average'][0]:.1f} before the sweep, "
                    f"{measured['load_average'][1]:.1f} after.")
    lines = [machine, "",
             ("This CPU's rates (Kiln's scheduler step, median of repeats, measured before and after the sweep; the "
              "mean is fitted):"), "", "| prefill step, prompt tokens | before ms | after ms | fit ms |",
             "|---:|---:|---:|---:|"]
    lines += [f"| {n} | {fits[0]['prefill_seconds'][n] * 1e3:.1f} | {fits[-1]['prefill_seconds'][n] * 1e3:.1f} | "
              f"{cost.seconds(0, 0, int(n)) * 1e3:.1f} |" for n in rates["prefill_seconds"]]
    lines += ["", "| decode step, rows | before ms | after ms | fit ms |", "|---:|---:|---:|---:|"]
    lines += [f"| {n} | {fits[0]['decode_seconds'][n] * 1e3:.1f} | {fits[-1]['decode_seconds'][n] * 1e3:.1f} | "
              f"{cost.seconds(int(n), 0) * 1e3:.1f} |" for n in rates["decode_seconds"]]
    lines += ["", fit_line, "", ("| offered req/s | completed | mean prompt / output tokens | predicted rows decoding | predicted "
                   "prefill share | TTFT p50 predicted / measured ms | ratio | TTFT mean predicted / server ms | "
                   "TPOT predicted / measured p50 ms | ratio | TPOT server mean ms |"),
              "|---:|---:|---|---:|---:|---|---:|---|---|---:|---:|"]
    for row in measured["rates"]:
        classes, _ = request_classes(args.artifact, row, measured.get("seed", 0))
        mean_p = sum(k.share * k.prompt_tokens for k in classes)
        mean_o = sum(k.share * k.output_tokens for k in classes)
        p = predict(cost, row["offered_rps"], classes, sequences_held(classes, blocks, block_size))
        mix = f"{mean_p:.0f} / {mean_o:.0f}"
        if "saturated" in p:
            lines.append(f"| {row['offered_rps']:g} | {row['completed']}/{row['sent']} | {mix} | saturated: "
                         f"{p['saturated']} | - | - / {ms(row['ttft_p50_s'])} | - | - / "
                         f"{ms(row.get('server_ttft_mean_s'))} | - / {ms(row['tpot_p50_s'])} | - | "
                         f"{ms(row.get('server_tpot_mean_s'))} |")
            continue
        lines.append(f"| {row['offered_rps']:g} | {row['completed']}/{row['sent']} | {mix} | {p['decode_rows']:.2f} | "
                     f"{p['prefill_share']:.0%} | {ms(p['ttft_p50_s'])} / {ms(row['ttft_p50_s'])} | "
                     f"{ratio(p['ttft_p50_s'], row['ttft_p50_s'])} | {ms(p['ttft_mean_s'])} / "
                     f"{ms(row.get('server_ttft_mean_s'))} | {ms(p['tpot_s'])} / {ms(row['tpot_p50_s'])} | "
                     f"{ratio(p['tpot_s'], row['tpot_p50_s'])} | {ms(row.get('server_tpot_mean_s'))} |")
    last = measured["rates"][-1]
    classes, _ = request_classes(args.artifact, last, measured.get("seed", 0))
    held = sequences_held(classes, blocks, block_size)
    capacity = most(lambda r: predict(cost, r, classes, held).get("saturated") is None, 1.0)
    lines += ["", (f"Capacity: the model's largest rate with a steady state, for the mix offered at "
                   f"{last['offered_rps']:g} req/s (the KV pool's {blocks} blocks of {block_size} tokens hold "
                   f"{held:.1f} of its sequences), is {capacity:.2f} req/s; the server completed "
                   f"{last['throughput_rps']:.2f} req/s there (completed / the time to the last completion, busy "
                   f"throughout), {last['rejected_429']} of {last['sent']} refused with 429.")]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
