"""Loading an artifact and running it: prefill, decode, sampling, batched generation, scoring.

    engine = runtime.load("artifacts/s260k-fp8")
    engine.generate(["Once upon a time"], max_new_tokens=64)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.errors import KilnError
from runtime.artifact import WEIGHTS, read_manifest
from runtime.kv_cache import ContiguousKVCache
from runtime.model import Transformer
from runtime.spec import ModelSpec, build_spec


def prefill(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
    return model(tokens, positions, cache)


def decode_one_token(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
    # tokens, positions: [B, 1] -> logits [B, V]
    return model(tokens, positions, cache)[:, -1]


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    # logits: [B, V] -> [B]
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(dim=-1) - sorted_probs < top_p  # always keeps the top token
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "eos" or "length"


class Engine:
    """An artifact loaded for execution. Holds the model (fp32 on CPU), its tokenizer and its manifest."""

    def __init__(self, spec: ModelSpec, tensors: Mapping[str, torch.Tensor], formats: Mapping[str, Mapping],
                 tokenizer=None, manifest: dict | None = None):
        self.spec = spec
        self.model = Transformer(spec, tensors, formats).eval()
        self.tokenizer = tokenizer
        self.manifest = manifest or {}

    @classmethod
    def from_tensors(cls, config: dict, tensors: Mapping[str, torch.Tensor], formats: Mapping[str, Mapping],
                     tokenizer=None, manifest: dict | None = None) -> Engine:
        """Build from in-memory tensors exactly as they would be read from the artifact's files."""
        return cls(build_spec(config), tensors, formats, tokenizer, manifest)

    # --- scoring -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def logits(self, token_lists: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Full-sequence logits for each token list ([len, V] each), batched with right padding."""
        lengths = [len(t) for t in token_lists]
        T = max(lengths)
        tokens = torch.zeros(len(token_lists), T, dtype=torch.long)
        for row, ids in enumerate(token_lists):
            tokens[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        positions = torch.arange(T).expand(len(token_lists), -1)
        logits = self.model(tokens, positions)
        return [logits[row, :n] for row, n in enumerate(lengths)]

    # --- generation ----------------------------------------------------------------------------------------
    def _tokenizer(self):
        if self.tokenizer is None:
            raise KilnError("this engine has no tokenizer; pass token ids or load an artifact with tokenizer files")
        return self.tokenizer

    @torch.inference_mode()
    def generate_ids(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64, temperature: float = 0.0,
                     top_p: float = 1.0, stop_ids: Sequence[int] = (), seed: int | None = None,
                     stop_check=None) -> list[tuple[list[int], str]]:
        if max_new_tokens < 0:
            raise KilnError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if not 0 < top_p <= 1:
            raise KilnError(f"top_p must be in (0, 1], got {top_p}")
        if any(len(p) == 0 for p in prompts):
            raise KilnError("every prompt needs at least one token")
        B = len(prompts)
        lengths = torch.tensor([len(p) for p in prompts])
        T = int(lengths.max())
        total = T + max_new_tokens
        if total > self.spec.max_position_embeddings:
            raise KilnError(f"prompt + max_new_tokens = {total} exceeds the model's context "
                            f"{self.spec.max_position_embeddings}")
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        cache = ContiguousKVCache(self.model.stream_shapes(), B, max(total, 1))
        tokens = torch.zeros(B, T, dtype=torch.long)
        for row, ids in enumerate(prompts):
            tokens[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        positions = torch.arange(T).expand(B, -1)
        logits = prefill(self.model, tokens, positions, cache)
        next_logits = logits[torch.arange(B), lengths - 1]
        outputs: list[list[int]] = [[] for _ in range(B)]
        reasons = ["length"] * B
        done = [False] * B
        stop_ids = set(stop_ids)
        position = lengths.clone()
        for _ in range(max_new_tokens):
            next_tokens = sample(next_logits, temperature, top_p, generator)
            for row in range(B):
                if done[row]:
                    continue
                token = int(next_tokens[row])
                if token in stop_ids:
                    done[row], reasons[row] = True, "eos"
                    continue
                outputs[row].append(token)
                if stop_check is not None and stop_check(outputs[row]):
                    done[row], reasons[row] = True, "stop"
            if all(done):
                break
            next_logits = decode_one_token(self.model, next_tokens.unsqueeze(1), position.unsqueeze(1), cache)
            position = position + 1
        return list(zip(outputs, reasons, strict=True))

    def generate(self, prompts: str | Sequence[str], max_new_tokens: int = 64, temperature: float = 0.0,
                 top_p: float = 1.0, stop: Sequence[str] | None = None, seed: int | None = None) -> list[Generation]:
        """Generate continuations for a batch of prompts of any lengths. Greedy when temperature is 0."""
        tok = self._tokenizer()
        if isinstance(prompts, str):
            prompts = [prompts]
        stop = [s for s in (stop or []) if s]
        ids = [tok(p)["input_ids"] for p in prompts]

        def stop_check(out: list[int]) -> bool:
            text = tok.decode(out, skip_special_tokens=True)
            return any(s in text for s in stop)

        results = self.generate_ids(ids, max_new_tokens, temperature, top_p, self.spec.eos_token_ids, seed,
                                    stop_check if stop else None)
        generations = []
        for prompt_ids, (out, reason) in zip(ids, results, strict=True):
            # decode prompt + continuation together so word-boundary spaces survive, then drop the prompt
            prefix = tok.decode(prompt_ids, skip_special_tokens=True)
            text = tok.decode(list(prompt_ids) + out, skip_special_tokens=True)[len(prefix):]
            if reason == "stop":
                cut = min(text.index(s) for s in stop if s in text)
                text = text[:cut]
            generations.append(Generation(text, out, reason))
        return generations


def load_tokenizer(path: Path | str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise KilnError(f"cannot load the tokenizer from {path}: {str(exc).splitlines()[0]}") from None


def load(path: Path | str) -> Engine:
    """Load an artifact directory: verify the schema and checksums, read the weights, build the engine."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(path)
    manifest = read_manifest(root)
    try:
        tensors = load_file(str(root / WEIGHTS))
    except (SafetensorError, OSError) as exc:
        raise KilnError(f"{root / WEIGHTS}: cannot read weights: {exc}") from None
    config = json.loads((root / "config.json").read_text())
    tokenizer = load_tokenizer(root) if (root / "tokenizer_config.json").exists() or (root / "tokenizer.json").exists() else None
    return Engine.from_tensors(config, tensors, manifest["formats"], tokenizer, manifest)
