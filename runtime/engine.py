"""Loading an artifact and running it: prefill, decode, batched generation, scoring.

    engine = runtime.load("artifacts/s260k-fp8")
    engine.generate(["Once upon a time"], max_new_tokens=64)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.kernels.errors import KilnError
from kiln.runtime.artifact import WEIGHTS, artifact_file, clip, has_tokenizer, read_manifest
from kiln.runtime.attention import attention_mask
from kiln.runtime.draft import DRAFT_KINDS, draft_module
from kiln.runtime.kv_format import resolve_kv_streams
from kiln.runtime.linear import QuantLinear, onednn_fits
from kiln.runtime.model import Transformer, place
from kiln.runtime.model_weights import Weights
from kiln.runtime.paged_kv_cache import (
    DEFAULT_BLOCK_SIZE,
    DecodeTables,
    PagedKVCache,
    StepView,
    kv_groups,
    pool_bytes_per_token,
)
from kiln.runtime.sampling import check_repetition_penalty
from kiln.runtime.scheduler import SamplingParams, Scheduler
from kiln.runtime.spec import ModelSpec, spec_from_json
from kiln.runtime.speculative import (
    DraftHeadDrafter,
    NgramTableDrafter,
    PromptLookupDrafter,
    check_tree_width,
    speculative_generate,
)


def prefill(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
    return model(tokens, positions, cache)


def decode_one_token(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
    # tokens, positions: [B, 1] -> logits [B, V]
    return model(tokens, positions, cache)[:, -1]


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "eos" or "length"


GENERATE_BATCH_TOKENS = 4096
"""Tokens `generate_ids` runs in one step at most (prompt chunks and decoding rows together)."""

DEFAULT_KV_CACHE_BYTES = 64 * 2**20
"""Size of the runtime's KV block pool when the caller names no block count, on CPU (the reference runtime)."""

DECODE_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
"""A static-shape decode step pads its batch up to the next of these (vLLM's CUDA-graph capture sizes are the
same idea); a larger batch runs unpadded."""
DECODE_LENGTH_STEP = 256
"""A static-shape decode step pads the history it reads up to a multiple of this many tokens."""

GPU_KV_CACHE_FRACTION = 0.5
"""On a GPU, the share of the memory free after loading the weights that the KV block pool takes by default
(vLLM's gpu_memory_utilization is the same idea, counted over the whole device)."""

RUNTIME_DEVICES = ("cpu", "cuda", "meta")
"""Device types an engine is placed on ("meta": shapes only, for tests that check device placement)."""

def resolve_placement(device: torch.device | str, dtype: torch.dtype | None,
                      packed: bool | None) -> tuple[torch.device, torch.dtype, bool]:
    """(device, compute dtype, packed) for a load: the CPU reference is fp32 with weights dequantized once; any
    other device defaults to bf16 activations over packed weights (what the Triton kernels run)."""
    asked = device
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in RUNTIME_DEVICES:
        raise KilnError(f"unknown device {clip(str(asked), 40)!r}: the runtime runs on cpu or cuda (cuda:N)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise KilnError(f"device {device} asked for, but this machine has no CUDA GPU (torch "
                        f"{torch.__version__}); use --device cpu")
    cpu = device.type == "cpu"
    dtype = (torch.float32 if cpu else torch.bfloat16) if dtype is None else dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise KilnError(f"compute dtype must be float32, bfloat16 or float16, got {dtype}")
    return device, dtype, (not cpu) if packed is None else packed


class Engine:
    """An artifact loaded for execution. Holds the model, its tokenizer and its manifest.

    `device` "cpu" (the default) is the reference: fp32, every weight dequantized once at load. Another device
    ("cuda") keeps FP8/FP4 weights packed (`packed` defaults to True there) and runs in `dtype` (bf16 by
    default); the KV pool, every index tensor of a forward and the sampling live on that device too, and a
    scheduler step reads back only its sampled token ids.

    The KV cache is paged (runtime.paged_kv_cache) and stored in the artifact's KV format (manifest
    "kv_cache"; `kv_cache` overrides it): `kv_cache_blocks` blocks of `kv_block_size` tokens, by default
    as many as fit in DEFAULT_KV_CACHE_BYTES. `generate_ids` runs its prompts on that pool through the
    continuous-batching scheduler (runtime.scheduler) and refuses a request that could never fit.
    """

    def __init__(self, spec: ModelSpec, tensors: Mapping[str, torch.Tensor], formats: Mapping[str, Mapping],
                 tokenizer=None, manifest: dict | None = None, kv_cache: Mapping | None = None,
                 kv_block_size: int = DEFAULT_BLOCK_SIZE, kv_cache_blocks: int | None = None,
                 repetition_penalty: float = 1.0, packed: bool | None = None, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None, onednn_head: bool = True):
        self.spec = spec
        self.device, self.dtype, self.packed = resolve_placement(device, dtype, packed)
        # one-token decode steps attend through the paged decode kernel, reading the KV pools as stored (on a
        # GPU; elsewhere the cache gathers and dequantizes the history for SDPA, the reference path)
        self.decode_kernel = self.device.type == "cuda"
        # the default for generate_ids, as the artifact's generation_config.json sets it for every server
        self.repetition_penalty = check_repetition_penalty(repetition_penalty)
        self.model = Transformer(spec, tensors, formats, packed=self.packed).eval().place(self.device, self.dtype)
        self.onednn_bytes = self._prepack_onednn(onednn_head)
        self.tokenizer = tokenizer
        self.manifest = manifest or {}
        self.kv_table = dict(kv_cache if kv_cache is not None else self.manifest.get("kv_cache") or {})
        self.kv_streams = resolve_kv_streams(spec, self.kv_table, tensors)
        self.kv_block_size = kv_block_size
        self.kv_windows = tuple(layer.attention.sliding_window for layer in spec.layers)
        if kv_cache_blocks is None:
            # a block id's bytes: with sliding windows, the storage the KV-cache groups share (runtime.paged_kv_cache)
            block_bytes = kv_block_size * pool_bytes_per_token(self.kv_streams, self.dtype, self.kv_windows)
            pool_bytes = DEFAULT_KV_CACHE_BYTES
            if self.device.type == "cuda":
                pool_bytes = int(torch.cuda.mem_get_info(self.device)[0] * GPU_KV_CACHE_FRACTION)
            kv_cache_blocks = max(1, pool_bytes // block_bytes)
        self.kv_cache_blocks = kv_cache_blocks
        self._kv_pool: PagedKVCache | None = None
        self._tensors, self._formats = tensors, formats
        self._draft = None
        self.last_speculative = None  # SpeculativeStats of the last speculative `generate`
        self._compiled_forward = None  # compile_decode()
        self._static_decode = False
        self._windows = tuple({None, *(layer.attention.sliding_window for layer in spec.layers)})

    def _prepack_onednn(self, head: bool = True) -> int:
        """On the CPU, give each fp32 linear a copy in oneDNN's blocked layout, which multiplies faster than MKL
        from the dense weight (QuantLinear.prepack_onednn), when the copies fit (runtime.linear.onednn_fits);
        the bytes added, 0 when not. `head` False leaves the lm_head out (the accuracy gate multiplies heads
        from their dense weights: at a 262K vocabulary its copy alone is 671 MB)."""
        if self.device.type != "cpu":
            return 0
        linears = [m for m in self.model.modules() if isinstance(m, QuantLinear)
                   and (head or m is not self.model.lm_head)]
        needed = sum(m.weight.numel() * m.weight.element_size() for m in linears)
        return sum(m.prepack_onednn() for m in linears) if onednn_fits(needed) else 0

    def compile_decode(self, mode: str | None = None, warmup: bool = True, static_shapes: bool | None = None) -> None:
        """Run every decode step (each row one new token on the paged cache: the scheduler's decode forward)
        through `torch.compile` of the model's forward. One traced graph replaces ~50 eager operations per
        layer; the cache is read and written through `PagedKVCache.step_view`, in place. It pays on CPU
        (SmolLM2-135M, one thread: about a quarter off a decode step, benchmarks/decode.py --compile). Two
        graphs are compiled, one for batch 1 and one for any larger batch (batch, history length and pool size
        are dynamic): about a minute each for a 135M model on CPU, at `warmup` (two dummy steps on a small
        cache) or else on first use. `mode` is torch.compile's ("reduce-overhead" captures CUDA graphs on a
        GPU). Prefill, prompt chunks and speculative verification stay eager.

        `static_shapes` (default: with "reduce-overhead"): every step runs at a bucketed shape, its batch padded
        up to the next of DECODE_BATCH_SIZES and its history to a multiple of DECODE_LENGTH_STEP (padding rows
        write and read only the null block; padded keys are masked), and the forward must trace as one graph
        (fullgraph: no host sync inside). A CUDA graph is captured once per bucket, not once per step."""
        self._static_decode = mode == "reduce-overhead" if static_shapes is None else static_shapes
        self._compiled_forward = torch.compile(self.model.forward, mode=mode, dynamic=None,
                                               fullgraph=self._static_decode)
        if warmup:
            # made outside inference mode, as the caches the engine serves from are (their tensors' dispatch keys
            # are part of what a compiled graph assumes)
            self._warm_up_decode(self.new_kv_cache(num_blocks=2 * len(kv_groups(self.kv_windows))))

    @torch.inference_mode()  # as the scheduler's steps run: grad mode is part of what a compiled graph assumes
    def _warm_up_decode(self, cache: PagedKVCache) -> None:
        for seq_id in range(2):
            cache.add_sequence(seq_id)
        for batch in (1, 2):  # histories of 2 and 3 tokens: a size 1 would compile a graph of its own
            positions = cache.prepare(list(range(batch)), torch.full((batch, 1), batch))
            self.decode_logits(torch.zeros(batch, 1, dtype=torch.long, device=self.device), positions, cache)

    @property
    def compiled(self) -> bool:
        return self._compiled_forward is not None

    def decode_logits(self, tokens: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """tokens, positions: [B, 1] of the forward `cache` has prepared -> logits [B, V]; compiled after
        `compile_decode` when `cache` is a PagedKVCache."""
        if self._compiled_forward is None or not isinstance(cache, PagedKVCache):
            return self.model(tokens, positions, cache)[:, -1]
        from torch._dynamo import maybe_mark_dynamic

        view = cache.step_view()
        batch = tokens.shape[0]
        if self._static_decode:
            tokens, positions, view = self._pad_step(tokens, positions, view, cache.null_slot)
        keys = torch.arange(view.length, device=positions.device).expand(tokens.shape[0], -1)
        # always a mask tensor (the eager path drops an all-true one): one graph serves every step
        view.step_masks = {window: attention_mask(positions, keys, window) for window in self._windows}
        masks = list(view.step_masks.values())
        storage = [getattr(pool, name) for layer in view.pools for pool in layer for name in pool.storage]
        if self._static_decode and self.device.type == "cuda" and not getattr(cache, "static_addresses", False):
            # the pools are written in place by every step: as static addresses a CUDA graph writes them where
            # they are (cudagraph trees would otherwise copy, or skip capturing, a mutated input)
            from torch._dynamo import mark_static_address

            for tensor in storage:
                mark_static_address(tensor)
            cache.static_addresses = True
        tables = [t for kernel in view.kernel or () for t in (kernel.block_table, kernel.context_lens)]
        for tensor in (tokens, positions, *view.write_slots, *view.read_slots, *masks, *storage, *tables):
            maybe_mark_dynamic(tensor, 0)
        for table in tables[::2]:
            maybe_mark_dynamic(table, 1)
        for mask in masks:
            maybe_mark_dynamic(mask, 3)
        return self._compiled_forward(tokens, positions, view)[:batch, -1]

    @staticmethod
    def _pad_step(tokens: torch.Tensor, positions: torch.Tensor, view, null_slot: int):
        """A decode step padded to its static bucket (see compile_decode): rows up to the next batch size, the
        history read up to a multiple of DECODE_LENGTH_STEP. Padding rows hold token 0 at position 0, written to
        and read from the null slot: they see one finite key and are cut off after the forward; padded keys lie
        past every real row's position, so the causal mask hides them."""
        from torch.nn.functional import pad


        B, S = tokens.shape[0], view.length
        rows = next((size for size in DECODE_BATCH_SIZES if size >= B), B) - B
        length = -(-S // DECODE_LENGTH_STEP) * DECODE_LENGTH_STEP
        read = tuple(pad(r.view(B, S), (0, length - S, 0, rows), value=null_slot).reshape(-1)
                     for r in view.read_slots)
        write = tuple(pad(w, (0, rows), value=null_slot) for w in view.write_slots)
        kernel = view.kernel
        if kernel is not None:  # padding rows read one token, the null block's first slot, which they wrote
            padded = []
            for tables in kernel:
                bs, table = tables.block_size, tables.block_table
                null_block = null_slot // bs
                width = -(-length // bs)
                padded.append(DecodeTables(pad(table, (0, width - table.shape[1], 0, rows), value=null_block),
                                           pad(tables.context_lens, (0, rows), value=1), bs))
            kernel = tuple(padded)
        return (pad(tokens, (0, 0, 0, rows)), pad(positions, (0, 0, 0, rows)),
                StepView(view.pools, write, read, length, kernel, view.layer_group))

    def draft_module(self):
        """The artifact's draft module (a DeepSeek MTP layer or a Kiln draft head: runtime.draft), built on
        first use; None when it has none."""
        if self._draft is None:
            module = next((m for m in self.spec.extra_modules if m.kind in DRAFT_KINDS), None)
            if module is None:
                return None
            draft = draft_module(module, Weights(self._tensors, self._formats, self.spec, self.packed), self.model)
            self._draft = place(draft.eval(), self.device, self.dtype)
        return self._draft

    def drafter(self, kind: str = "auto", corpus: Sequence[Sequence[int]] | None = None,
                tree_width: int | None = None, num_blocks: int | None = None):
        """A drafter for speculative decoding: "head" (the artifact's MTP layer or draft head), "prompt-lookup",
        "trigram" (a table of `corpus`), or "auto" (head when the artifact has one, else prompt lookup).
        `tree_width` > 1 (head, greedy): the top-`tree_width` tokens at each depth are verified as a tree;
        None: the width the artifact's spec records for its draft module (the one its draft-head pass was gated
        with; an artifact built before the spec carried it: its pass record's), else 1. `num_blocks`: the head's own KV
        pool, one layer's (default: twice the engine's block count, room for a scheduler on the engine's pool and
        every sequence's drafts past its end)."""

        if tree_width is None:
            module = next((m for m in self.spec.extra_modules if m.kind in DRAFT_KINDS), None)
            tree_width = module.tree_width if module is not None else None
        if tree_width is None:
            tree_width = next((p["config"].get("tree_width", 1) for p in self.manifest.get("passes") or ()
                               if p.get("name") == "draft-head" and p.get("decision") != "reverted"), 1)
        check_tree_width(tree_width)

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

    def speculative_ids(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64, draft_tokens: int = 4,
                        drafter=None, temperature: float = 0.0, top_p: float = 1.0, stop_ids: Sequence[int] = (),
                        seed: int | None = None, repetition_penalty: float | None = None):
        """`generate_ids` with speculative decoding: ([(tokens, reason)], SpeculativeStats). Greedy output is
        generate_ids' token for token; sampled output has its distribution (runtime.speculative)."""

        if not 0 < top_p <= 1:
            raise KilnError(f"top_p must be in (0, 1], got {top_p}")
        penalty = check_repetition_penalty(self.repetition_penalty if repetition_penalty is None
                                           else repetition_penalty)
        return speculative_generate(self, prompts, max_new_tokens, drafter or self.drafter(), draft_tokens,
                                    temperature, top_p, stop_ids, seed, penalty)

    def new_kv_cache(self, num_blocks: int, block_size: int | None = None, prefix_caching: bool = False) -> PagedKVCache:
        """An empty paged cache in this engine's KV formats."""
        return PagedKVCache(self.kv_streams, num_blocks, block_size or self.kv_block_size, self.dtype,
                            prefix_caching=prefix_caching, device=self.device, decode_kernel=self.decode_kernel,
                            windows=self.kv_windows)

    @property
    def kv_pool(self) -> PagedKVCache:
        """The block pool `generate_ids` serves from (created on first use, kept between calls)."""
        if self._kv_pool is None:
            self._kv_pool = self.new_kv_cache(self.kv_cache_blocks)
        return self._kv_pool

    # --- scoring -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def logits(self, token_lists: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Full-sequence logits for each token list ([len, V] each), batched with right padding.

        Attention reads K/V back from a paged cache in the artifact's KV format (a scratch pool sized to the
        batch), so scoring sees the same cached values as token-by-token decoding. A list longer than the
        model's context is refused, as `generate_ids` refuses one.
        """
        return self._score_forward(token_lists, self.model)

    @torch.inference_mode()
    def hidden_states(self, token_lists: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The final norm's output for each token list ([len, C] each, fp32): `logits` without the lm_head.

        Scorers keep these ([tokens, C]) instead of logits ([tokens, V], which at a 128K vocabulary is a
        hundred times larger) and apply `head_logits` a chunk of positions at a time."""
        return self._score_forward(token_lists, self.model.hidden)

    @torch.inference_mode()
    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The lm_head applied to final hidden states: [..., C] -> [..., V]. Per position, so a chunk of the
        positions of `hidden_states` gives exactly those positions' rows of `logits`."""
        return self.model.lm_head(hidden)

    def _check_context(self, lengths: Sequence[int]) -> None:
        """Refuse sequences longer than the model's context (positions past it were never trained)."""
        longest = max(lengths, default=0)
        if longest > self.spec.max_position_embeddings:
            raise KilnError(f"a token list of {longest} tokens exceeds the model's context "
                            f"{self.spec.max_position_embeddings}; cut it to the context first")

    def _score_forward(self, token_lists: Sequence[Sequence[int]], forward) -> list[torch.Tensor]:
        """`forward(tokens, positions, cache)` ([B, T, ...]) over the lists right-padded into one batch, cut
        back to each list's length."""
        lengths = [len(t) for t in token_lists]
        self._check_context(lengths)
        T = max(lengths)
        tokens = torch.zeros(len(token_lists), T, dtype=torch.long)
        for row, ids in enumerate(token_lists):
            tokens[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        positions = torch.arange(T).expand(len(token_lists), -1)
        # one forward writes every position, so each KV-cache group holds a sequence's whole length meanwhile
        cache = self.new_kv_cache(len(kv_groups(self.kv_windows)) * sum(-(-n // self.kv_block_size) for n in lengths))
        rows = list(range(len(token_lists)))
        for row in rows:
            cache.add_sequence(row)
        positions = cache.prepare(rows, positions, positions < torch.tensor(lengths).unsqueeze(1))
        out = forward(tokens.to(self.device), positions, cache)
        return [out[row, :n] for row, n in enumerate(lengths)]

    # --- generation ----------------------------------------------------------------------------------------
    def _tokenizer(self):
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

    def _prefill_rows(self, cache: PagedKVCache, rows: Sequence, prompts: Sequence[Sequence[int]],
                      collect: tuple[int, ...] | None = None):
        """Prefill the prompts of `rows` (right-padded, padding never cached): the logits after each prompt,
        [B, V] (the lm_head runs on those positions only). With `collect` (speculative decoding): (logits, the
        last layer's features [B, T, C], what a drafter reads: the same, or the layers in `collect`
        concatenated; see Transformer.features)."""
        lengths = torch.tensor([len(prompts[row]) for row in rows])
        T = int(lengths.max())
        tokens = torch.zeros(len(rows), T, dtype=torch.long)
        for i, row in enumerate(rows):
            tokens[i, : len(prompts[row])] = torch.as_tensor(prompts[row], dtype=torch.long)
        positions = torch.arange(T).expand(len(rows), -1)
        positions = cache.prepare(rows, positions, positions < lengths.unsqueeze(1))
        features = self.model.features(tokens.to(self.device), positions, cache, collect=collect or ())
        last, collected = features if collect else (features, features)
        picked = (torch.arange(len(rows), device=self.device), lengths.to(self.device) - 1)
        logits = self.model.lm_head(self.model.norm(last[picked]))
        return logits if collect is None else (logits, last, collected)

    def generate(self, prompts: str | Sequence[str], max_new_tokens: int = 64, temperature: float = 0.0,
                 top_p: float = 1.0, stop: Sequence[str] | None = None, seed: int | None = None,
                 repetition_penalty: float | None = None, speculative: bool = False, draft_tokens: int = 4,
                 drafter=None) -> list[Generation]:
        """Generate continuations for a batch of prompts of any lengths. Greedy when temperature is 0.
        `speculative`: draft `draft_tokens` a step with `drafter` (default: the artifact's draft head or MTP
        layer, else prompt lookup) and verify them in one forward; `self.last_speculative` keeps the stats."""
        tok = self._tokenizer()
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
    from kiln.runtime.tokenizer import Tokenizer, readable

    try:
        if readable(path):
            return Tokenizer(path)
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
    from safetensors import SafetensorError
    from safetensors.torch import load_file

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
