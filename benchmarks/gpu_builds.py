"""`optimize build --device cuda` against the CPU reference: each build once with --device cuda and (unless
--no-cpu) once on the CPU, and a table of wall time, exit code and the gate's figures from each manifest.

    .venv/bin/python benchmarks/gpu_builds.py [--smollm2 DIR] [--no-cpu] [--timeout S]

Builds: stories260K `auto --weight-bits 5.0` (sampling, sensitivity probes and 600 tuning steps; on a GPU its
gate runs through the packed bf16 runtime, so its figures differ from the fp32 CPU gate's by that much), and
with --smollm2 DIR (a Hugging Face checkpoint written by ../shared/models/SmolLM2-135M-Instruct/to_hf.py)
SmolLM2 `nvfp4-w4a16`, whose 200 tuning steps fit the GPU's tuning budget (2^50) and not the CPU's. Without
a GPU it prints one line and exits 0. Written without a GPU to run it on (none was lent): the CPU rows are
the figures measured so far.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kiln.optimizer.defaults import STORIES260K


def one_build(checkpoint: Path, args: list[str], device: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "art"
        cmd = [sys.executable, "-m", "kiln.optimizer.cli", "build", str(checkpoint), *args, "--device", device,
               "-o", str(out)]
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout)
            code = proc.returncode
            tail = "" if code == 0 else (proc.stderr.strip().splitlines() or [""])[-1]  # the one-line error
        except subprocess.TimeoutExpired:
            code, tail = "timeout", f"over {timeout:.0f} s"
        row = {"device": device, "seconds": time.perf_counter() - start, "exit": code, "last": tail}
        manifest = out / "manifest.json"
        if manifest.exists():
            gate = json.loads(manifest.read_text())["passes"][-1]["attempts"][-1].get("gate") or {}
            row.update({k: gate.get(k) for k in ("recovery", "kl", "top1")})
        return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smollm2", type=Path, help="SmolLM2-135M-Instruct as a Hugging Face checkpoint")
    parser.add_argument("--no-cpu", action="store_true", help="only the --device cuda builds")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per build")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_builds: no CUDA GPU on this machine; nothing to build")
        return 0
    builds = [("stories260K auto 5.0", STORIES260K, ["--recipe", "auto", "--weight-bits", "5.0", "--paragraphs", "600"])]
    if args.smollm2 is not None:
        builds.append(("SmolLM2 nvfp4-w4a16", args.smollm2,
                       ["--recipe", "nvfp4-w4a16", "--paragraphs", "200", "--min-recovery", "0.95", "--min-top1", "0.85"]))
    print(f"## optimize build --device cuda ({torch.cuda.get_device_name()})\n")
    print("| build | device | seconds | exit | recovery | KL | top-1 | error |")
    print("|---|---|---|---|---|---|---|---|")
    failed = False
    for label, checkpoint, build_args in builds:
        for device in ("cuda",) if args.no_cpu else ("cuda", "cpu"):
            r = one_build(checkpoint, build_args, device, args.timeout)
            failed |= device == "cuda" and r["exit"] != 0
            figures = " | ".join("-" if r.get(k) is None else f"{r[k]:.4f}" for k in ("recovery", "kl", "top1"))
            print(f"| {label} | {device} | {r['seconds']:.0f} | {r['exit']} | {figures} | {r['last'][:80]} |",
                  flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
