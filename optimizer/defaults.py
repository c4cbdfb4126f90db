"""The embedded default: the real stories260K model when ../shared is beside the project, else a small
generated Llama checkpoint (random weights, byte-level tokenizer trained on a bundled text) in a cache dir.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from kiln.optimizer.output_dir import follow_umask

PROJECT_ROOT = Path(__file__).resolve().parent.parent
SAMPLE_TEXT = Path(__file__).resolve().parent / "data" / "sample.txt"

# ../shared beside the project (tests and benchmarks use these fixed places; shared_dir() also looks near the cwd)
SHARED_BESIDE = (PROJECT_ROOT / ".." / "shared").resolve()
STORIES260K = SHARED_BESIDE / "models" / "stories260K"
CALIBRATION_TEXT = SHARED_BESIDE / "data" / "tinystories" / "calibration.txt"
EVALUATION_TEXT = SHARED_BESIDE / "data" / "tinystories" / "evaluation.txt"


def shared_dir() -> Path | None:
    for candidate in (Path.cwd() / ".." / "shared", SHARED_BESIDE, Path.cwd() / "shared"):
        if (candidate / "models" / "stories260K" / "model.safetensors").is_file():
            return candidate.resolve()
    return None


def default_checkpoint() -> tuple[Path, str]:
    """(checkpoint dir, a sentence saying which default it is)."""
    shared = shared_dir()
    if shared is not None:
        return shared / "models" / "stories260K", f"embedded default: the real stories260K model ({shared})"
    path = generated_checkpoint()
    return path, (f"embedded default: ../shared is absent, so a small generated Llama checkpoint with random "
                  f"weights ({path}); its accuracy figures mean nothing")


def default_data(kind: str) -> Path:
    """evaluation.txt / calibration.txt from ../shared when present, else the bundled sample text."""
    shared = shared_dir()
    if shared is not None:
        return shared / "data" / "tinystories" / f"{kind}.txt"
    return SAMPLE_TEXT


def generated_checkpoint(path: Path | None = None) -> Path:
    """A small random Llama with a real BPE tokenizer, written once (atomically) and reused."""
    path = path or Path(os.environ.get("KILN_CACHE", Path.home() / ".cache" / "kiln")) / "generated-llama"
    if (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file():
        return path
    # lazy: torch, tokenizers and transformers take seconds to import; only a machine without ../shared gets here
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers.processors import TemplateProcessing
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train([str(SAMPLE_TEXT)], trainer)
    tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        fast.save_pretrained(tmp)
        hf_logging.disable_progress_bar()  # "Writing model shards" is not the user's business
        try:
            LlamaForCausalLM(config).save_pretrained(tmp)
        finally:
            hf_logging.enable_progress_bar()
        follow_umask(tmp)
        shutil.rmtree(path, ignore_errors=True)  # an earlier, interrupted attempt
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
