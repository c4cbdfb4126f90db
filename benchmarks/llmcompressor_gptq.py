"""llm-compressor's GPTQ NVFP4A16 of a checkpoint, calibrated on the paragraphs Kiln calibrates on, for
benchmarks/precision.py --external to score against the fp32 source.

    python3 -m venv /root/llmc-venv && /root/llmc-venv/bin/pip install torch==2.13.0 "llmcompressor==0.14.*"
    OMP_NUM_THREADS=1 /root/llmc-venv/bin/python benchmarks/llmcompressor_gptq.py ~/.cache/kiln/gemma-3-270m \
        /work/runs/llmc-gemma-nvfp4a16 [--samples 256]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/precision.py --checkpoint ~/.cache/kiln/gemma-3-270m \
        --rows "llm-compressor GPTQ NVFP4A16" --external "/work/runs/llmc-gemma-nvfp4a16,llm-compressor GPTQ NVFP4A16" \
        --paragraphs 200 --ood-data OOD.txt

The recipe is llm-compressor's NVFP4A16 example with GPTQ: GPTQModifier(scheme="NVFP4A16", targets="Linear",
ignore=["lm_head"]) (its defaults: block 128, dampening 0.01, static activation order), through `oneshot`, saved
compressed (compressed-tensors nvfp4-pack-quantized). Calibration follows Kiln's protocol
(calibration/data.py): the first --samples paragraphs of calibration.txt (split at blank lines), each tokenized
on its own with BOS and cut at min(256, context) tokens, lists under 2 tokens dropped, one sample a batch (no
padding, no shuffling needed). This venv has no Kiln, so the few lines of that protocol are repeated here; the
token lists used are written beside the checkpoint (calibration_tokens.json) to be checked against Kiln's.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CALIB = ROOT.parent / "shared" / "data" / "tinystories" / "calibration.txt"
MAX_TOKENS = 256


def calibration_lists(tokenizer, path: Path, samples: int, context: int) -> list[list[int]]:
    paragraphs = [p for p in re.split(r"\n\s*\n", path.read_text()) if p.strip()][:samples]
    cap = min(MAX_TOKENS, context)
    return [ids[:cap] for ids in (tokenizer(p)["input_ids"] for p in paragraphs) if len(ids) >= 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--samples", type=int, default=256, help="calibration paragraphs (Kiln observes 256)")
    ap.add_argument("--calib-data", type=Path, default=CALIB)
    args = ap.parse_args()

    import llmcompressor
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32)
    lists = calibration_lists(tokenizer, args.calib_data, args.samples, model.config.max_position_embeddings)
    data = Dataset.from_dict({"input_ids": lists, "attention_mask": [[1] * len(ids) for ids in lists]})
    recipe = GPTQModifier(scheme="NVFP4A16", targets="Linear", ignore=["lm_head"])
    start = time.perf_counter()
    oneshot(model=model, processor=tokenizer, dataset=data, recipe=recipe, num_calibration_samples=len(lists),
            max_seq_length=MAX_TOKENS, shuffle_calibration_samples=False, batch_size=1)
    seconds = time.perf_counter() - start
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)
    (args.out / "calibration_tokens.json").write_text(json.dumps(lists))
    info = {"llmcompressor": llmcompressor.__version__, "samples": len(lists), "tokens": sum(map(len, lists)),
            "oneshot_seconds": round(seconds, 1)}
    (args.out / "llmcompressor_run.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info))


if __name__ == "__main__":
    main()
