"""Helpers for the precision and export tests: a tokenizer small enough for the tiny random checkpoints, so
they go through `optimizer.build.build` (calibration text, gate, artifact) like a real model does."""

from __future__ import annotations

import shutil
from pathlib import Path

SAMPLE_TEXT = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "tinystories" / "sample.txt"
if not SAMPLE_TEXT.is_file():  # ../shared absent: the text bundled with the optimizer
    SAMPLE_TEXT = Path(__file__).resolve().parent.parent / "optimizer" / "data" / "sample.txt"


def add_tokenizer(checkpoint: Path, vocab_size: int) -> Path:
    """Train a BPE tokenizer with at most `vocab_size` ids on the sample text and save it beside the weights."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  limit_alphabet=vocab_size // 2, show_progress=False)
    tokenizer.train([str(SAMPLE_TEXT)], trainer)
    tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    if len(fast) > vocab_size:
        raise ValueError(f"tokenizer has {len(fast)} ids, the model {vocab_size}")
    fast.save_pretrained(checkpoint)
    return checkpoint


def tiny_with_tokenizer(model_type: str, root: Path) -> Path:
    """A tiny random checkpoint of `model_type` (tests.tiny_models) that has a tokenizer."""
    import json

    from tests.tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(model_type, root / model_type)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    return add_tokenizer(path, vocab)


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
