"""Loading an artifact and running it: the `Engine` façade over a model runner, a scheduler and drafters.

    engine = runtime.load("artifacts/s260k-fp8")
    engine.generate(["Once upon a time"], max_new_tokens=64)
    engine.generate_ids([prompt_ids], 64, temperature=0.7, seed=1)     # [(new tokens, finish reason)]
    engine.logits([token_ids])                                         # scoring: [[len, V]]

The model, its placement, compiled decoding, prefill, the scoring forwards and the KV pools are the
`ModelRunner`'s (runtime.model_runner); generation runs on the continuous-batching scheduler
(runtime.scheduler), speculative generation in runtime.speculative with the drafters of runtime.drafters.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kiln.kernels.errors import KilnError
from kiln.runtime.artifact import WEIGHTS, artifact_file, clip, has_tokenizer, read_manifest
from kiln.runtime.draft import DRAFT_KINDS
from kiln.runtime.drafters import DraftHeadDrafter, NgramTableDrafter, PromptLookupDrafter
from kiln.runtime.kv_format import resolve_kv_streams
from kiln.runtime.model import Transformer
from kiln.runtime.model_runner import ModelRunner, resolve_placement
from kiln.runtime.paged_kv_cache import DEFAULT_BLOCK_SIZE, PagedKVCache
from kiln.runtime.request import SamplingParams
from kiln.runtime.sampling import check_repetition_penalty
from kiln.runtime.scheduler import Scheduler
from kiln.runtime.spec import ModelSpec, spec_from_json
from kiln.runtime.speculative import check_tree_width, speculative_generate
from kiln.runtime.tokenizer import Tokenizer, readable


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "eos" or "length"


GENERATE_BATCH_TOKENS = 4096
"""Tokens `generate_ids` runs in one step at most (prompt chunks and decoding rows together)."""


class Engine:
    """An artifact loaded for execution: its `ModelRunner` (`runner`), its tokenizer and its manifest.

    `device` "cpu" (the default) is the reference: fp32, every weight dequantized once at load. Another device
    ("cuda") keeps FP8/FP4 weights packed (`packed` defaults to True there) and runs in `dtype` (bf16 by
    default); the KV pool, every index tensor of a forward and the sampling live on that device too, and a
    scheduler step reads back only its sampled token ids.

    The KV cache is paged (runtime.paged_kv_cache) and stored in the artifact's KV format (manifest
    "kv_cache"; `kv_cache` overrides it): `kv_cache_blocks` blocks of `kv_block_size` tokens, by default
    as many as fit in runtime.model_runner.DEFAULT_KV_CACHE_BYTES. `fuse` (on the dequantized path): q/k/v and
    gate/up run as one product each where they can (ModelRunner). `generate_ids` runs its prompts on that pool
    through the continuous-batching scheduler (runtime.scheduler) and refuses a request that could never fit.
    """

    def __init__(self, spec: ModelSpec, tensors: Mapping[str, torch.Tensor], formats: Mapping[str, Mapping],
                 tokenizer=None, manifest: dict | None = None, kv_cache: Mapping | None = None,
                 kv_block_size: int = DEFAULT_BLOCK_SIZE, kv_cache_blocks: int | None = None,
                 repetition_penalty: float = 1.0, packed: bool | None = None, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None, onednn_head: bool = True, fuse: bool = True):
        self.spec = spec
        device, dtype, packed = resolve_placement(device, dtype, packed)
        # the default for generate_ids, as the artifact's generation_config.json sets it for every server
        self.repetition_penalty = check_repetition_penalty(repetition_penalty)
        self.tokenizer = tokenizer
        self.manifest = manifest or {}
        kv_table = kv_cache if kv_cache is not None else self.manifest.get("kv_cache") or {}
        self.runner = ModelRunner(spec, tensors, formats, kv_table, kv_block_size, kv_cache_blocks, packed, device,
                                  dtype, onednn_head, fuse)
        self.last_speculative = None  # SpeculativeStats of the last speculative `generate`

    # --- the runner's model, placement and KV pools (runtime.model_runner) -------------------------------------
    @property
    def model(self) -> Transformer:
        return self.runner.model

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    @property
    def packed(self) -> bool:
        return self.runner.packed

    @property
    def decode_kernel(self) -> bool:
        """Whether one-token decode steps attend through the paged decode kernel (see ModelRunner)."""
        return self.runner.decode_kernel

    @decode_kernel.setter
    def decode_kernel(self, value: bool) -> None:
        self.runner.decode_kernel = value

    @property
    def onednn_bytes(self) -> int:
        return self.runner.onednn_bytes

    @property
    def kv_table(self) -> dict:
        return self.runner.kv_table

    @property
    def kv_streams(self):
        return self.runner.kv_streams

    @property
    def kv_block_size(self) -> int:
        return self.runner.kv_block_size

    @property
    def kv_windows(self) -> tuple[int | None, ...]:
        return self.runner.kv_windows

    @property
    def kv_cache_blocks(self) -> int:
        return self.runner.kv_cache_blocks

    @kv_cache_blocks.setter
    def kv_cache_blocks(self, value: int) -> None:
        self.runner.kv_cache_blocks = value

    @property
    def kv_pool(self) -> PagedKVCache:
        """The block pool `generate_ids` serves from (created on first use, kept between calls); assigning
        None drops it."""
        return self.runner.kv_pool

    @kv_pool.setter
    def kv_pool(self, cache: PagedKVCache | None) -> None:
        self.runner.kv_pool = cache

    @property
    def compiled(self) -> bool:
        return self.runner.compiled is not None

    def compile_decode(self, mode: str | None = None, warmup: bool = True, static_shapes: bool | None = None) -> None:
        """ModelRunner.compile_decode: every decode step through `torch.compile` of the model's forward."""
        self.runner.compile_decode(mode, warmup, static_shapes)

    def new_kv_cache(self, num_blocks: int, block_size: int | None = None, prefix_caching: bool = False) -> PagedKVCache:
        """An empty paged cache in this engine's KV formats."""
        return self.runner.new_kv_cache(num_blocks, block_size, prefix_caching)

    def decode_logits(self, tokens: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        return self.runner.decode_logits(tokens, positions, cache)

    def features(self, tokens: torch.Tensor, positions: torch.Tensor, cache, collect: tuple[int, ...] = ()):
        return self.runner.features(tokens, positions, cache, collect)

    def logits_from_features(self, features: torch.Tensor) -> torch.Tensor:
        return self.runner.logits_from_features(features)

    def prefill_rows(self, cache: PagedKVCache, rows: Sequence, prompts: Sequence[Sequence[int]],
                     collect: tuple[int, ...] | None = None):
        """ModelRunner.prefill_rows: the logits after each prompt of `rows`, [B, V]."""
        return self.runner.prefill_rows(cache, rows, prompts, collect)

    # --- scoring -------------------------------------------------------------------------------------------
    def logits(self, token_lists: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Full-sequence logits for each token list ([len, V] each): ModelRunner.logits."""
        return self.runner.logits(token_lists)

    def hidden_states(self, token_lists: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The final norm's output for each token list ([len, C] each): ModelRunner.hidden_states."""
        return self.runner.hidden_states(token_lists)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The lm_head applied to final hidden states: [..., C] -> [..., V]."""
        return self.runner.head_logits(hidden)

    # --- drafting ------------------------------------------------------------------------------------------
    def draft_module(self):
        """The artifact's draft module (a DeepSeek MTP layer or a Kiln draft head: runtime.draft), built on
        first use; None when it has none."""
        return self.runner.draft_module()

    def drafter(self, kind: str = "auto", corpus: Sequence[Sequence[int]] | None = None,
                tree_width: int | None = None, num_blocks: int | None = None):
        """A drafter for speculative decoding: "head" (the artifact's MTP layer or draft head), "prompt-lookup",
        "trigram" (a table of `corpus`), or "auto" (head when the artifact has one, else prompt lookup).
        `tree_width` > 1 (head, greedy): the top-`tree_width` tokens at each depth are verified as a tree;
        None: the width the artifact's spec records for its draft module (the one its draft-head pass was gated
        with; an artifact built before the spec carried it: its pass record's), else 1. `num_blocks`: the head's own KV
        pool, one layer's (default: twice the engine's block count, room for a scheduler on the engine's pool and
        every sequence's drafts past its end)."""
        tree_width = check_tree_width(self._tree_width() if tree_width is None else tree_width)
        if kind == "auto":
            kind = "head" if self.draft_module() is not None else "prompt-lookup"
        if kind == "head":
            module = self.draft_module()
            if module is None:
                raise KilnError("this artifact has no draft head or MTP layer: build it with the draft-head pass, "
                                "or use --draft prompt-lookup")
            streams = resolve_kv_streams(
                dataclasses.replace(self.spec, layers=(module.spec.layer,), extra_modules=()), {})[0]
            return DraftHeadDrafter(module, num_blocks or 2 * self.kv_cache_blocks, self.kv_block_size, streams,
                                    tree_width, self.dtype, self.device)
        if kind == "prompt-lookup":
            return PromptLookupDrafter()
        if kind == "trigram":
            if corpus is None:
                raise KilnError("the trigram drafter needs a corpus (token lists) to count")
            return NgramTableDrafter.from_corpus(corpus)
        raise KilnError(f"unknown drafter {kind!r}: auto, head, prompt-lookup or trigram")

    def _tree_width(self) -> int:
        """The draft tree width the artifact records: its spec's draft module's, else its draft-head pass's."""
        module = next((m for m in self.spec.extra_modules if m.kind in DRAFT_KINDS), None)
        width = module.tree_width if module is not None else None
        if width is None:
            width = next((p["config"].get("tree_width", 1) for p in self.manifest.get("passes") or ()
                          if p.get("name") == "draft-head" and p.get("decision") != "reverted"), 1)
        return width

    def speculative_ids(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64, draft_tokens: int = 4,
                        drafter=None, temperature: float = 0.0, top_p: float = 1.0, stop_ids: Sequence[int] = (),
                        seed: int | None = None, repetition_penalty: float | None = None):
        """`generate_ids` with speculative decoding: ([(tokens, reason)], SpeculativeStats). Greedy output is
        generate_ids' token for token; sampled output has its distribution (runtime.speculative)."""
        if not 0 < top_p <= 1:
            raise KilnError(f"top_p must be in (0, 1], got {top_p}")
        penalty = check_repetition_penalty(self.repetition_penalty if repetition_penalty is None
                                           else repetition_penalty)
        return speculative_generate(self.runner, prompts, max_new_tokens, drafter or self.drafter(), draft_tokens,
                                    temperature, top_p, stop_ids, seed, penalty)

    # --- generation ----------------------------------------------------------------------------------------
    def require_tokenizer(self):
        """The engine's tokenizer; a KilnError when it has none."""
        if self.tokenizer is None:
            raise KilnError("this engine has no tokenizer; pass token ids or load an artifact with tokenizer files")
        return self.tokenizer

    def generate_ids(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64, temperature: float = 0.0,
                     top_p: float = 1.0, stop_ids: Sequence[int] = (), seed: int | None = None,
                     stop_check=None, repetition_penalty: float | None = None) -> list[tuple[list[int], str]]:
        """Continue each prompt (token ids): [(new tokens, "eos" | "stop" | "length")]. Greedy when temperature
        is 0; with `seed`, prompt i samples with its own generator seeded `seed + i`. `repetition_penalty`
        None: the engine's (the artifact's generation_config.json, else 1).

        The prompts run through the continuous-batching scheduler (runtime.scheduler) on the engine's block
        pool: they join as blocks allow, prefill in chunks next to the others' decoding, and the latest
        admitted is preempted (and later recomputed) when blocks run out; a prompt that could never fit is
        refused before anything runs."""
        return [(out, reason) for out, reason, _ in self._generate(
            prompts, max_new_tokens, temperature, top_p, stop_ids, seed, stop_check, repetition_penalty)]

    def _generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float, top_p: float,
                  stop_ids: Sequence[int], seed: int | None, stop_check, repetition_penalty: float | None,
                  stop: Sequence[str] = (), tokenizer=None) -> list[tuple[list[int], str, str]]:
        """[(new tokens, finish reason, their text)] for each prompt; the text is "" without `tokenizer`."""
        penalty = check_repetition_penalty(self.repetition_penalty if repetition_penalty is None
                                           else repetition_penalty)
        self._check_request(prompts, max_new_tokens, top_p)
        if not prompts or max_new_tokens == 0:
            return [([], "length", "") for _ in prompts]
        cache = self.kv_pool
        for row, prompt in enumerate(prompts):
            blocks = cache.sequence_blocks(len(prompt) + max_new_tokens - 1, 1)  # chunks are cut to fit
            if blocks > cache.num_blocks:
                raise KilnError(f"prompt {row} ({len(prompt)} tokens + {max_new_tokens} new) needs {blocks} "
                                f"KV-cache blocks of {cache.block_size} tokens; the cache has {cache.num_blocks} "
                                "(raise kv_cache_blocks or shorten the request)")
        scheduler = Scheduler(self, cache, max_num_seqs=len(prompts), max_num_batched_tokens=GENERATE_BATCH_TOKENS,
                              max_queue=None, tokenizer=tokenizer)
        requests = [scheduler.add_request(prompt, SamplingParams(
            max_new_tokens, temperature, top_p, None if seed is None else seed + row, tuple(stop), tuple(stop_ids),
            penalty), row, stop_check) for row, prompt in enumerate(prompts)]
        scheduler.run()
        return [(r.output_ids, r.finish_reason, r.text) for r in requests]

    def _check_request(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, top_p: float) -> None:
        """Refuse what generation cannot run: a negative length, top_p outside (0, 1], an empty prompt, or a
        prompt that with its new tokens exceeds the model's context."""
        if max_new_tokens < 0:
            raise KilnError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if not 0 < top_p <= 1:
            raise KilnError(f"top_p must be in (0, 1], got {top_p}")
        if any(len(p) == 0 for p in prompts):
            raise KilnError("every prompt needs at least one token")
        total = max(len(p) for p in prompts) + max_new_tokens if prompts else 0
        if total > self.spec.max_position_embeddings:
            raise KilnError(f"prompt + max_new_tokens = {total} exceeds the model's context "
                            f"{self.spec.max_position_embeddings}")

    def generate(self, prompts: str | Sequence[str], max_new_tokens: int = 64, temperature: float = 0.0,
                 top_p: float = 1.0, stop: Sequence[str] | None = None, seed: int | None = None,
                 repetition_penalty: float | None = None, speculative: bool = False, draft_tokens: int = 4,
                 drafter=None) -> list[Generation]:
        """Generate continuations for a batch of prompts of any lengths. Greedy when temperature is 0.
        `speculative`: draft `draft_tokens` a step with `drafter` (default: the artifact's draft head or MTP
        layer, else prompt lookup) and verify them in one forward; `self.last_speculative` keeps the stats."""
        tok = self.require_tokenizer()
        if isinstance(prompts, str):
            prompts = [prompts]
        stop = [s for s in (stop or []) if s]
        ids = [tok(p)["input_ids"] for p in prompts]

        def stop_check(out: list[int]) -> bool:
            text = tok.decode(out, skip_special_tokens=True)
            return any(s in text for s in stop)

        if not speculative:  # the scheduler decodes the text as it goes and stops at a stop string
            results = self._generate(ids, max_new_tokens, temperature, top_p, self.spec.eos_token_ids, seed, None,
                                     repetition_penalty, stop, tok)
            return [Generation(text, out, reason) for out, reason, text in results]
        results, self.last_speculative = self.speculative_ids(
            ids, max_new_tokens, draft_tokens, drafter, temperature, top_p, self.spec.eos_token_ids, seed,
            repetition_penalty)
        if stop:  # where plain decoding would have stopped: the first token that completes a stop string
            results = [next(((out[:n], "stop") for n in range(1, len(out) + 1) if stop_check(out[:n])),
                            (out, reason)) for out, reason in results]
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
    """The tokenizer in directory `path` (a checkpoint or an artifact). Whatever goes wrong reading it
    (missing, malformed or hostile files) is a one-line KilnError; its code runs only with trust_remote_code.

    A tokenizer.json of transformers' generic class is read by runtime.tokenizer.Tokenizer (the `tokenizers`
    library and jinja2: milliseconds, the same ids and text as transformers); any other tokenizer (a
    model-specific class, a sentencepiece model only, custom code) by transformers' AutoTokenizer, which costs
    seconds of imports."""
    try:
        if readable(path):
            return Tokenizer(path)
        # lazy: transformers takes seconds to import, and only tokenizers Tokenizer cannot read need it
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 -- tokenizer files are input; any failure to parse them is theirs
        lines = str(exc).strip().splitlines()
        detail = clip(lines[0] if lines else type(exc).__name__, 160)
        raise KilnError(f"cannot load the tokenizer from {clip(path)}: {detail}") from None


def load(path: Path | str, packed: bool | None = None, device: torch.device | str = "cpu",
         dtype: torch.dtype | None = None, kv_cache: Mapping | None = None) -> Engine:
    """Load an artifact directory: verify the schema, shape and checksums, read the weights, build the engine.

    Reads only files the manifest's checksum table lists (`runtime.artifact.artifact_file`); the tokenizer
    loader reads the directory, which `read_manifest` has checked holds no unlisted file.
    packed=False (the CPU reference) dequantizes every weight once, to fp32. packed=True keeps FP8 and FP4
    weights as stored and multiplies through kiln.kernels.gpu (runtime.linear.PackedLinear): Triton kernels
    where Triton runs (CUDA tensors, or TRITON_INTERPRET=1), their torch references elsewhere. On CPU that is
    a check of the kernels' path, not a fast one (the references dequantize at every product).
    `device` "cuda" keeps the weights packed on the GPU with `dtype` (default bf16) activations: see Engine.
    `packed` None: packed everywhere but on the CPU. `kv_cache`: a KV table in place of the artifact's (`{}`:
    every layer's cache unquantized), e.g. to measure what the KV format alone changes."""
    device, dtype, packed = resolve_placement(device, dtype, packed)
    root = Path(path)
    manifest = read_manifest(root)
    weights = artifact_file(root, manifest, WEIGHTS)
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as exc:
        raise KilnError(f"{clip(weights)}: cannot read weights: {clip(str(exc).strip(), 120)}") from None
    spec = spec_from_json(manifest["architecture"])  # the structure the passes left, not the source's config
    tokenizer = load_tokenizer(root) if has_tokenizer(manifest) else None
    return Engine(spec, tensors, manifest["formats"], tokenizer, manifest, kv_cache=kv_cache,
                  repetition_penalty=generation_defaults(root, manifest).get("repetition_penalty", 1.0),
                  packed=packed, device=device, dtype=dtype)


def generation_defaults(root: Path, manifest: dict) -> dict:
    """The sampling defaults of the artifact's generation_config.json that the runtime applies (as vLLM does
    with --generation-config auto): repetition_penalty."""
    if "generation_config.json" not in (manifest.get("files") or {}):
        return {}
    return read_generation_defaults(artifact_file(root, manifest, "generation_config.json"))


def read_generation_defaults(path: Path) -> dict:
    """generation_config.json's defaults the runtime applies ({} when the file is absent)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KilnError(f"{clip(path)}: not valid JSON: {clip(str(exc), 100)}") from None
    if not isinstance(data, dict):
        raise KilnError(f"{clip(path)}: must hold a JSON object")
    out = {}
    if data.get("repetition_penalty") is not None:
        try:
            out["repetition_penalty"] = check_repetition_penalty(data["repetition_penalty"])
        except KilnError as exc:
            raise KilnError(f"{clip(path)}: {exc}") from None
    return out
