"""The model on its device: placement, compiled decoding, prefill, scoring forwards and the KV pools.

    runner = ModelRunner(spec, tensors, manifest["formats"], kv_table, device="cpu")
    cache = runner.new_kv_cache(num_blocks=64)
    cache.add_sequence(0)
    logits = runner.prefill_rows(cache, [0], [prompt_ids])            # [1, V]: after the prompt
    positions = cache.prepare([0], torch.tensor([[len(prompt_ids)]]))
    logits = runner.decode_logits(next_token, positions, cache)      # [1, V]
    runner.logits([prompt_ids])                                       # scoring: [[len, V]]

The continuous-batching scheduler (runtime.scheduler) and speculative decoding (runtime.speculative) use a
runner through the small protocol in runtime.runner_protocol; `Engine` (runtime.engine) adds the tokenizer,
the artifact's generation defaults and generation on top. `prefill` and `decode_one_token` are the same
forwards as free functions over a bare model (gpt-fast's).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kiln.kernels.errors import KilnError
from kiln.runtime.artifact import clip
from kiln.runtime.compiled_decode import CompiledDecode
from kiln.runtime.draft import DRAFT_KINDS, draft_module
from kiln.runtime.kv_format import resolve_kv_streams
from kiln.runtime.kv_pools import kv_groups, pool_bytes_per_token
from kiln.runtime.linear import QuantLinear, onednn_fits
from kiln.runtime.model import Transformer, place
from kiln.runtime.model_weights import Weights
from kiln.runtime.paged_kv_cache import DEFAULT_BLOCK_SIZE, PagedKVCache
from kiln.runtime.spec import ModelSpec

DEFAULT_KV_CACHE_BYTES = 64 * 2**20
"""Size of the runtime's KV block pool when the caller names no block count, on CPU (the reference runtime)."""

GPU_KV_CACHE_FRACTION = 0.5
"""On a GPU, the share of the memory free after loading the weights that the KV block pool takes by default
(vLLM's gpu_memory_utilization is the same idea, counted over the whole device)."""

RUNTIME_DEVICES = ("cpu", "cuda", "meta")
"""Device types an engine is placed on ("meta": shapes only, for tests that check device placement)."""


def prefill(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
    return model(tokens, positions, cache)


def decode_one_token(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
    # tokens, positions: [B, 1] -> logits [B, V]
    return model(tokens, positions, cache)[:, -1]


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


class ModelRunner:
    """A model built from an artifact's tensors and placed for execution, with its KV-cache layout.

    `device` "cpu" (the default) is the reference: fp32, every weight dequantized once at load. Another device
    ("cuda") keeps FP8/FP4 weights packed (`packed` defaults to True there) and runs in `dtype` (bf16 by
    default); the KV pools and every index tensor of a forward live on that device too.

    The KV cache is paged (runtime.paged_kv_cache) and stored in the formats of `kv_table` (the manifest's
    "kv_cache" table): `kv_cache_blocks` blocks of `kv_block_size` tokens for `kv_pool`, by default as many as
    fit in DEFAULT_KV_CACHE_BYTES (on a GPU, GPU_KV_CACHE_FRACTION of the memory left free).

    `fuse` (the default): on the dequantized path, sibling linears that read one input (q/k/v, gate/up) run as
    one product (runtime.model_weights.Weights.siblings); the packed path runs them as the artifact stores them
    (the `fuse` pass concatenates their stored bytes at build time).
    """

    def __init__(self, spec: ModelSpec, tensors: Mapping[str, torch.Tensor], formats: Mapping[str, Mapping],
                 kv_table: Mapping | None = None, kv_block_size: int = DEFAULT_BLOCK_SIZE,
                 kv_cache_blocks: int | None = None, packed: bool | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype | None = None, onednn_head: bool = True,
                 fuse: bool = True):
        self.spec = spec
        self.device, self.dtype, self.packed = resolve_placement(device, dtype, packed)
        # one-token decode steps attend through the paged decode kernel, reading the KV pools as stored (on a
        # GPU; elsewhere the cache gathers and dequantizes the history for SDPA, the reference path)
        self.decode_kernel = self.device.type == "cuda"
        # fuse: an unfused artifact's q/k/v and gate/up become one product each on the dequantized path (as vLLM
        # fuses them at load): one GEMM reads the three weights in one pass (benchmarks/results/decode.md)
        self.model = Transformer(spec, tensors, formats, packed=self.packed, fuse=fuse).eval().place(self.device,
                                                                                                   self.dtype)
        self.onednn_bytes = self._prepack_onednn(onednn_head)
        self.kv_table = dict(kv_table or {})
        self.kv_streams = resolve_kv_streams(spec, self.kv_table, tensors)
        self.kv_block_size = kv_block_size
        self.kv_windows = tuple(layer.attention.sliding_window for layer in spec.layers)
        self.kv_cache_blocks = self._default_blocks() if kv_cache_blocks is None else kv_cache_blocks
        self.kv_pool_cache: PagedKVCache | None = None  # kv_pool, made on first use
        self.tensors, self.formats = tensors, formats  # what draft_module builds from
        self.draft: torch.nn.Module | None = None  # draft_module(), built on first use
        self.compiled: CompiledDecode | None = None  # compile_decode()

    def _default_blocks(self) -> int:
        """As many blocks as fit the default pool size: on a GPU, a share of the memory still free."""
        # a block id's bytes: with sliding windows, the storage the KV-cache groups share (runtime.paged_kv_cache)
        block_bytes = self.kv_block_size * pool_bytes_per_token(self.kv_streams, self.dtype, self.kv_windows)
        pool_bytes = DEFAULT_KV_CACHE_BYTES
        if self.device.type == "cuda":
            pool_bytes = int(torch.cuda.mem_get_info(self.device)[0] * GPU_KV_CACHE_FRACTION)
        return max(1, pool_bytes // block_bytes)

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

    # --- KV pools ------------------------------------------------------------------------------------------
    def new_kv_cache(self, num_blocks: int, block_size: int | None = None, prefix_caching: bool = False) -> PagedKVCache:
        """An empty paged cache in this model's KV formats."""
        return PagedKVCache(self.kv_streams, num_blocks, block_size or self.kv_block_size, self.dtype,
                            prefix_caching=prefix_caching, device=self.device, decode_kernel=self.decode_kernel,
                            windows=self.kv_windows)

    @property
    def kv_pool(self) -> PagedKVCache:
        """The block pool plain and speculative generation serve from (created on first use, kept between
        calls); assigning None drops it, so the next use makes one of `kv_cache_blocks` blocks."""
        if self.kv_pool_cache is None:
            self.kv_pool_cache = self.new_kv_cache(self.kv_cache_blocks)
        return self.kv_pool_cache

    @kv_pool.setter
    def kv_pool(self, cache: PagedKVCache | None) -> None:
        self.kv_pool_cache = cache

    # --- decoding ------------------------------------------------------------------------------------------
    def compile_decode(self, mode: str | None = None, warmup: bool = True, static_shapes: bool | None = None) -> None:
        """Run every decode step (each row one new token on the paged cache: the scheduler's decode forward)
        through `torch.compile` of the model's forward (runtime.compiled_decode). One traced graph replaces
        ~50 eager operations per layer. It pays on CPU (SmolLM2-135M, one thread: about a quarter off a decode
        step, benchmarks/decode.py --compile). Two graphs are compiled, one for batch 1 and one for any larger
        batch: about a minute each for a 135M model on CPU, at `warmup` (two dummy steps on a small cache) or
        else on first use. `mode` is torch.compile's ("reduce-overhead" captures CUDA graphs on a GPU).
        Prefill, prompt chunks and speculative verification stay eager.

        `static_shapes` (default: with "reduce-overhead"): every step runs at a bucketed shape (see
        runtime.compiled_decode), and the forward must trace as one graph (fullgraph: no host sync inside)."""
        windows = tuple({None, *self.kv_windows})
        compiled = CompiledDecode(self.model, self.device, windows, mode, static_shapes)
        if warmup:
            # made outside inference mode, as the caches the engine serves from are (their tensors' dispatch keys
            # are part of what a compiled graph assumes)
            self._warm_up_decode(compiled, self.new_kv_cache(num_blocks=2 * len(kv_groups(self.kv_windows))))
        # set once its graphs are compiled: a warm-up that fails leaves the runner eager, not half compiled
        self.compiled = compiled

    @torch.inference_mode()  # as the scheduler's steps run: grad mode is part of what a compiled graph assumes
    def _warm_up_decode(self, compiled: CompiledDecode, cache: PagedKVCache) -> None:
        for seq_id in range(2):
            cache.add_sequence(seq_id)
        for batch in (1, 2):  # histories of 2 and 3 tokens: a size 1 would compile a graph of its own
            positions = cache.prepare(list(range(batch)), torch.full((batch, 1), batch))
            compiled(torch.zeros(batch, 1, dtype=torch.long, device=self.device), positions, cache)

    def decode_logits(self, tokens: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """tokens, positions: [B, 1] of the forward `cache` has prepared -> logits [B, V]; compiled after
        `compile_decode` when `cache` is a PagedKVCache."""
        if self.compiled is None or not isinstance(cache, PagedKVCache):
            return self.model(tokens, positions, cache)[:, -1]
        return self.compiled(tokens, positions, cache)

    def features(self, tokens: torch.Tensor, positions: torch.Tensor, cache,
                 collect: tuple[int, ...] = ()):
        """The last layer's output before the final norm [B, T, C] (with `collect`, also those layers' outputs
        concatenated): Transformer.features."""
        return self.model.features(tokens, positions, cache, collect=collect)

    def logits_from_features(self, features: torch.Tensor) -> torch.Tensor:
        """The final norm and the lm_head on last-layer features: [..., C] -> [..., V]."""
        return self.model.lm_head(self.model.norm(features))

    def prefill_rows(self, cache: PagedKVCache, rows: Sequence, prompts: Sequence[Sequence[int]],
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
        logits = self.logits_from_features(last[picked])
        return logits if collect is None else (logits, last, collected)

    # --- scoring -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def logits(self, token_lists: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Full-sequence logits for each token list ([len, V] each), batched with right padding.

        Attention reads K/V back from a paged cache in the model's KV format (a scratch pool sized to the
        batch), so scoring sees the same cached values as token-by-token decoding. A list longer than the
        model's context is refused, as generation refuses one.
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

    def check_context(self, lengths: Sequence[int]) -> None:
        """Refuse sequences longer than the model's context (positions past it were never trained)."""
        longest = max(lengths, default=0)
        if longest > self.spec.max_position_embeddings:
            raise KilnError(f"a token list of {longest} tokens exceeds the model's context "
                            f"{self.spec.max_position_embeddings}; cut it to the context first")

    def _score_forward(self, token_lists: Sequence[Sequence[int]], forward) -> list[torch.Tensor]:
        """`forward(tokens, positions, cache)` ([B, T, ...]) over the lists right-padded into one batch, cut
        back to each list's length."""
        lengths = [len(t) for t in token_lists]
        self.check_context(lengths)
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

    # --- draft module --------------------------------------------------------------------------------------
    def draft_module(self):
        """The artifact's draft module (a DeepSeek MTP layer or a Kiln draft head: runtime.draft), built on
        first use; None when it has none."""
        if self.draft is None:
            module = next((m for m in self.spec.extra_modules if m.kind in DRAFT_KINDS), None)
            if module is None:
                return None
            draft = draft_module(module, Weights(self.tensors, self.formats, self.spec, self.packed), self.model)
            self.draft = place(draft.eval(), self.device, self.dtype)
        return self.draft
