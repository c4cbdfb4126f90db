"""What `optimize serve`'s default background compile costs and pays: start-up, requests while it compiles, the
time until the compiled step is in use, and requests after, against an eager server (`--compile off`).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/serve_compile.py ARTIFACT [--requests 20] [--max-tokens 32]
        [--modes off,auto] [--timeout 600]

Per mode, one server (a subprocess on loopback, benchmarks/serve_load.py's ServerProcess):
1. ready: seconds from launch until GET /health answers 200;
2. under load: `--requests` greedy completions, one after another with no gap (EOS ignored, `--max-tokens`
   each): the median request time, and how many ran while /health still said "eager";
3. idle: no request, until /health says "decode": "compiled" (auto) -- seconds from ready, and of those the
   seconds the server was idle;
4. after: `--requests` more completions, median request time.
Every completion's text must be the same (greedy): the last column counts those that are.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import ServerProcess

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play"


def run_requests(server: ServerProcess, count: int, max_tokens: int) -> tuple[list[float], list[str], int]:
    """`count` greedy completions back to back: (seconds each, texts, how many ran while decoding was eager)."""
    seconds, texts, eager = [], [], 0
    with httpx.Client(timeout=600) as http:
        for _ in range(count):
            start = time.perf_counter()
            body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            response = http.post(f"{server.url}/v1/completions", json=body)
            response.raise_for_status()
            seconds.append(time.perf_counter() - start)
            texts.append(response.json()["choices"][0]["text"])
            eager += http.get(f"{server.url}/health").json()["decode"] == "eager"
    return seconds, texts, eager


def measure(artifact: Path, mode: str, requests: int, max_tokens: int, timeout: float) -> dict:
    server = ServerProcess(artifact, ["--compile", mode], Path(tempfile.mkdtemp(prefix="kiln-serve-compile-")))
    ready = time.monotonic()
    try:
        loaded, texts, eager = run_requests(server, requests, max_tokens)
        busy = time.monotonic() - ready
        compiled_at = None
        if mode != "off":
            while time.monotonic() - ready < timeout:
                if httpx.get(f"{server.url}/health", timeout=10).json()["decode"] == "compiled":
                    compiled_at = time.monotonic() - ready
                    break
                time.sleep(0.2)
        after, more, _ = run_requests(server, requests, max_tokens)
    finally:
        code = server.stop()
    return {"mode": mode, "ready": server.startup_seconds, "loaded": statistics.median(loaded), "eager": eager,
            "compiled_at": compiled_at, "idle": None if compiled_at is None else compiled_at - busy,
            "after": statistics.median(after), "texts": texts + more, "exit": code}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--modes", default="off,auto")
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait for the compiled step")
    args = parser.parse_args()
    rows = [measure(args.artifact, mode, args.requests, args.max_tokens, args.timeout)
            for mode in args.modes.split(",")]
    reference = rows[0]["texts"][0]
    print(f"\n{args.artifact.name}: {args.requests} greedy requests of {args.max_tokens} tokens back to back, then "
          "idle until compiled, then as many again\n")
    print("| --compile | ready s | request s under load (median) | of them eager | compiled after s (idle s) "
          "| request s after (median) | identical texts | exit |")
    print("|---|---:|---:|---:|---|---:|---:|---:|")
    for r in rows:
        compiled = "-" if r["compiled_at"] is None else f"{r['compiled_at']:.1f} ({r['idle']:.1f})"
        same = sum(t == reference for t in r["texts"])
        print(f"| {r['mode']} | {r['ready']:.1f} | {r['loaded']:.2f} | {r['eager']}/{args.requests} | {compiled} "
              f"| {r['after']:.2f} | {same}/{len(r['texts'])} | {r['exit']} |")


if __name__ == "__main__":
    main()
