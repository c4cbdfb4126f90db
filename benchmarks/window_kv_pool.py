"""What a pool holds when sliding-window layers keep only their window: Gemma 3 270M's KV pool sized from a
memory budget (as the engine sizes it), with and without KV-cache groups, and the sequences that fit.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/window_kv_pool.py [--checkpoint ~/.cache/kiln/gemma-3-270m]

"before": one block table per sequence, every layer's storage per block id, every layer keeps its whole history
(Kiln's paged cache before the window groups). "after": runtime.paged_kv_cache's groups (a block id is one
group's storage slot; a window group holds its window), at steady decode (forwards of one token) and with
prompt chunks of 512 tokens (a window group's peak while a 512-token chunk runs). Sequences = blocks //
blocks per sequence. Storage only (shapes on the meta device): nothing is run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kiln.optimizer.loader import load_checkpoint
from kiln.runtime.kv_format import layer_windows, resolve_kv_streams
from kiln.runtime.kv_pools import pool_bytes_per_token, stored_bytes_per_token
from kiln.runtime.paged_kv_cache import PagedKVCache

BUDGETS = (("64 MiB, fp32 (the CPU engine's default pool)", 64 * 2**20, torch.float32),
           ("8 GiB, bf16", 8 * 2**30, torch.bfloat16))
CONTEXTS = (2062, 4096, 32768)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=Path.home() / ".cache" / "kiln" / "gemma-3-270m")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    spec = load_checkpoint(args.checkpoint).spec
    streams = resolve_kv_streams(spec, None)
    windows = [layer_windows(spec)[layer.index] for layer in spec.layers]
    bs = args.block_size
    print(f"{len(spec.layers)} layers, windows "
          f"{sorted({w for w in windows if w})}, {sum(w is None for w in windows)} full-attention layers; "
          f"blocks of {bs} tokens\n")
    print("| budget | context | before: blocks (bytes each) | before: seqs | after: blocks (bytes each) | "
          "after: blocks a seq, decode / 512-chunks | after: seqs, decode / 512-chunks |")
    print("|---|---|---|---|---|---|---|")
    for name, budget, dtype in BUDGETS:
        before_block = bs * stored_bytes_per_token(streams, dtype)
        after_block = bs * pool_bytes_per_token(streams, dtype, windows)
        before_blocks, after_blocks = budget // before_block, budget // after_block
        cache = PagedKVCache(streams, after_blocks, bs, dtype, device="meta", windows=windows)
        for context in CONTEXTS:
            before_need = -(-context // bs)
            decode, chunked = cache.sequence_blocks(context, 1), cache.sequence_blocks(context, 512)
            print(f"| {name} | {context} | {before_blocks} ({before_block:,}) | {before_blocks // before_need} | "
                  f"{after_blocks} ({after_block:,}) | {decode} / {chunked} | {after_blocks // decode} / "
                  f"{after_blocks // chunked} |")


if __name__ == "__main__":
    main()
