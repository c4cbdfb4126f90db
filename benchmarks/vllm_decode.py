"""vLLM's side of benchmarks/decode.py: the CPU decode step of a checkpoint in vLLM, one thread.

Run in the vLLM venv (docs/exports.md), by `benchmarks/decode.py --vllm-python PYTHON`:

    OMP_NUM_THREADS=1 ~/vllm-venv/bin/python benchmarks/vllm_decode.py CHECKPOINT eager|compiled \
        --batches 1,8,32 [--prompt-tokens 16] [--new-tokens 32] [--repeats 3]

Per batch: B prompts of random tokens (seeded as decode.py seeds them), greedy, EOS ignored; ms per decode step
= (time of a `generate` of new_tokens + 1 tokens - time of a 1-token `generate`) / new_tokens, the best of
--repeats. fp32 weights, as Kiln's CPU path reads them. One JSON line per batch on stdout.
"""

import argparse
import json
import os
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: plenty for 32 x 48 tokens
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")  # one thread, on core 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("mode", choices=("eager", "compiled"))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(model=args.checkpoint, dtype="float32", enforce_eager=args.mode == "eager",
              max_model_len=args.prompt_tokens + args.new_tokens + 8, max_num_seqs=max(batches))
    vocab = llm.get_tokenizer().vocab_size
    for batch in batches:
        gen = torch.Generator().manual_seed(batch)
        prompts = [TokensPrompt(prompt_token_ids=row) for row in
                   torch.randint(3, vocab, (batch, args.prompt_tokens), generator=gen).tolist()]

        def run(tokens: int, prompts: list = prompts) -> float:
            params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0, ignore_eos=True)
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - start

        run(4)  # warm-up
        best = min(run(args.new_tokens + 1) - run(1) for _ in range(args.repeats))
        print(json.dumps({"batch": batch, "mode": args.mode, "ms": round(best / args.new_tokens * 1000, 2)}),
              flush=True)


if __name__ == "__main__":
    main()
