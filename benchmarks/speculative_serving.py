"""Speculative decoding under load through `optimize serve`: tokens/s, TPOT and tau per concurrency, with and
without speculation, and the break-even concurrency (issue #19, item 4).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speculative_serving.py ARTIFACT [--concurrency 1,4,8,16,32]
        [--requests-per-client 2] [--max-tokens 64] [--draft head] [--draft-tokens 4] [--tree-width W]
        [--max-num-batched-tokens 1024] [--json] [--out FILE.json] [--machine TEXT]

Two servers on loopback, one after the other: `optimize serve ARTIFACT` and the same with `--speculative`.
At each concurrency C, C closed-loop clients each stream --requests-per-client greedy completions, one after
another: prompts are the first 16 words of evaluation.txt paragraphs (C x requests-per-client distinct ones),
max_tokens --max-tokens with EOS ignored, so both servers generate the same number of tokens. Per C and server:
generated tokens / wall time, TPOT and TTFT p50 (at the client), and for the speculative server tau (tokens a
verification emits per request row: kiln_spec_decode_num_emitted_tokens / num_verifications over that C's
requests) and draft acceptance. Every speculative text must equal the plain server's (greedy: lossless); the
break-even concurrency is the smallest C where speculation's tokens/s falls below plain's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from serve_load import ServerProcess, _client, percentile, stream_completion

from kiln.optimizer.defaults import EVALUATION_TEXT

PROMPT_WORDS = 16
SPEC_COUNTERS = ("num_verifications", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def prompts(count: int) -> list[str]:
    paragraphs = [p.split() for p in EVALUATION_TEXT.read_text().split("\n\n") if len(p.split()) >= PROMPT_WORDS]
    if len(paragraphs) < count:
        raise SystemExit(f"{EVALUATION_TEXT} has {len(paragraphs)} paragraphs of {PROMPT_WORDS}+ words; need {count}")
    return [" ".join(p[:PROMPT_WORDS]) for p in paragraphs[:count]]


async def closed_loop(url: str, bodies: list[dict], clients: int):
    """`clients` workers take the bodies in order, one request at a time each; (results by index, wall s)."""
    pending = list(enumerate(bodies))
    results = {}
    async with _client(clients) as client:
        async def worker():
            while pending:
                index, body = pending.pop(0)
                results[index] = await stream_completion(client, url, body)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return results, time.perf_counter() - start


def spec_counters(server: ServerProcess) -> dict[str, float]:
    m = server.metrics()
    return {name: m.get(f"kiln_spec_decode_{name}_total", 0.0) for name in SPEC_COUNTERS}


def measure(server: ServerProcess, concurrency: list[int], per_client: int, max_tokens: int, texts: list[str]) -> dict:
    """Per concurrency: tokens/s, TPOT/TTFT p50, the texts, and the speculative counters' increments."""
    out = {}
    asyncio.run(closed_loop(server.url, [{"prompt": texts[0], "max_tokens": 8, "temperature": 0}], 1))  # warm-up
    for c in concurrency:
        bodies = [{"prompt": t, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
                  for t in texts[:c * per_client]]
        before = spec_counters(server)
        results, wall = asyncio.run(closed_loop(server.url, bodies, c))
        after = spec_counters(server)
        bad = [i for i, r in results.items() if not r.completed]
        if bad:
            raise SystemExit(f"concurrency {c}: request {bad[0]} failed: {results[bad[0]].error}")
        tokens = sum(r.tokens for r in results.values())
        out[c] = {"tokens_per_s": tokens / wall, "tokens": tokens, "wall_s": wall,
                  "tpot_p50_ms": 1000 * percentile([r.tpot for r in results.values() if r.tpot is not None], 50),
                  "ttft_p50_ms": 1000 * percentile([r.ttft for r in results.values() if r.ttft is not None], 50),
                  "texts": [results[i].text for i in range(len(bodies))],
                  **{k: after[k] - before[k] for k in SPEC_COUNTERS}}
        row = out[c]
        tau = row["num_emitted_tokens"] / row["num_verifications"] if row["num_verifications"] else None
        log(f"  concurrency {c}: {row['tokens_per_s']:.1f} tokens/s, TPOT p50 {row['tpot_p50_ms']:.1f} ms"
            + (f", tau {tau:.2f}" if tau else ""))
    return out


def tree_width_of(banner: str) -> int:
    """The tree width the server's startup line names (1: a chain)."""
    marker = ", a tree of "
    return int(banner.split(marker)[1].split()[0]) if marker in banner else 1


def commit() -> str:
    import subprocess

    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    return out.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--concurrency", default="1,4,8,16,32", help="closed-loop clients, comma-separated")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--draft", default="head", help="the speculative server's drafter: head, prompt-lookup")
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--tree-width", type=int, help="the head's tree width (default: the artifact's)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", type=Path, help="write the measurement as JSON (`optimize report --speculation`)")
    parser.add_argument("--machine", default="", help="where this runs, recorded in --out")
    args = parser.parse_args()
    concurrency = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    if not concurrency or min(concurrency) < 1 or args.requests_per_client < 1 or args.max_tokens < 2:
        raise SystemExit("--concurrency needs integers >= 1, --requests-per-client >= 1, --max-tokens >= 2")
    texts = prompts(max(concurrency) * args.requests_per_client)
    common = ["--max-num-seqs", str(max(concurrency)), "--max-queue", str(4 * max(concurrency)),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    speculative = ["--speculative", "--draft", args.draft, "--draft-tokens", str(args.draft_tokens),
                   *(["--tree-width", str(args.tree_width)] if args.tree_width else [])]
    runs = {}
    with tempfile.TemporaryDirectory() as logs:
        for name, flags in (("plain", common), ("speculative", [*common, *speculative])):
            log(f"{name}: optimize serve {args.artifact} {' '.join(flags)}")
            server = ServerProcess(args.artifact, flags, Path(logs))
            try:
                banner = [line for line in server.log.read_text().splitlines() if "speculative decoding" in line]
                runs[name] = measure(server, concurrency, args.requests_per_client, args.max_tokens, texts)
                runs[name]["banner"] = banner[0] if banner else ""
            finally:
                server.stop()
    plain, spec = runs["plain"], runs["speculative"]
    rows, break_even = [], None
    for c in concurrency:
        p, s = plain[c], spec[c]
        tau = s["num_emitted_tokens"] / s["num_verifications"] if s["num_verifications"] else float("nan")
        acceptance = s["num_accepted_tokens"] / s["num_draft_tokens"] if s["num_draft_tokens"] else float("nan")
        same = sum(a == b for a, b in zip(p["texts"], s["texts"], strict=True))
        speedup = s["tokens_per_s"] / p["tokens_per_s"]
        if break_even is None and speedup < 1:
            break_even = c
        rows.append({"concurrency": c, "plain_tokens_per_s": p["tokens_per_s"], "spec_tokens_per_s": s["tokens_per_s"],
                     "speedup": speedup, "tau": tau, "acceptance": acceptance, "plain_tpot_p50_ms": p["tpot_p50_ms"],
                     "spec_tpot_p50_ms": s["tpot_p50_ms"], "plain_ttft_p50_ms": p["ttft_p50_ms"],
                     "spec_ttft_p50_ms": s["ttft_p50_ms"], "identical": f"{same}/{len(p['texts'])}"})
    width = args.tree_width or tree_width_of(spec["banner"])
    measurement = {"rows": rows, "break_even": break_even, "banner": spec["banner"], "draft_tokens": args.draft_tokens,
                   "tree_width": width, "verified_per_sequence": args.draft_tokens * width,
                   "machine": args.machine, "command": " ".join(sys.argv), "commit": commit()}
    if args.out:
        args.out.write_text(json.dumps(measurement, indent=2) + "\n")
        log(f"wrote {args.out}")
    if args.json:
        print(json.dumps(measurement, indent=2))
    else:
        print(f"server: {spec['banner']}")
        print("| concurrency | plain tokens/s | speculative tokens/s | speedup | tau | acceptance | TPOT p50 ms "
              "plain / spec | TTFT p50 ms plain / spec | greedy texts identical |")
        print("|---:|---:|---:|---:|---:|---:|---|---|---:|")
        for r in rows:
            print(f"| {r['concurrency']} | {r['plain_tokens_per_s']:.1f} | {r['spec_tokens_per_s']:.1f} | "
                  f"{r['speedup']:.2f}x | {r['tau']:.2f} | {r['acceptance']:.3f} | {r['plain_tpot_p50_ms']:.1f} / "
                  f"{r['spec_tpot_p50_ms']:.1f} | {r['plain_ttft_p50_ms']:.1f} / {r['spec_ttft_p50_ms']:.1f} | "
                  f"{r['identical']} |")
        print(f"\nbreak-even concurrency: {break_even if break_even else f'none up to {max(concurrency)}'}")
    if any(r["identical"].split("/")[0] != r["identical"].split("/")[1] for r in rows):
        sys.exit("speculative greedy texts differ from plain serving's (listed above)")


if __name__ == "__main__":
    main()
