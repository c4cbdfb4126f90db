"""Sensitivity through the runtime (`ModelRunner.logit_kl`, optimizer.measure.runner) and its picture (a layers x
formats heatmap).

    kl = LogitKl(source_graph, calibration_token_lists)
    kl(graph, paragraphs)  -> mean over next-token positions of KL(source || graph) of the final logits,
                              on the first `paragraphs` calibration paragraphs, computed with the runtime's
                              modules and KV cache (what engine_from_graph(graph).logits computes)

A precision pass probes one group in one format at a time (hundreds of probes on a 30-layer model), so a
probe pays only for what it changed:
  - the runtime's modules are built once and kept (`_ProbeModel`); a call rebuilds only the parts (the
    embedding, a block, the final norm + lm_head) whose tensors or format entries differ from those the kept
    part was built from, compared by identity (passes replace tensors, never mutate them), and re-resolves
    each layer's KV-cache streams, compared by value (snapshots deep-copy the KV annotations);
  - the hidden states at the input of blocks are kept (`_Probe`): a probe whose first change is block L runs
    blocks L..end plus the head, from the nearest kept input at or before L;
  - the source's reference is its final hidden states (after the final norm), not its log-probabilities:
    the KL is computed through both lm_heads a chunk of tokens at a time.
Memory beyond the kept model (one fp32 copy, holding the graph tensors its parts read, which the identity
checks need; plus the source's lm_head while a probe replaces it): the source's final hidden states
[tokens, hidden] fp32, and the kept block inputs, at most `max_prefix_bytes` (default 256 MiB). One block
input is padded tokens x hidden x 4 bytes: 64 TinyStories paragraphs on SmolLM2 are 5312 padded tokens,
11.7 MiB, so all 31 would take 362 MiB and the default keeps every second one (a probe then runs at most one
block more than it changed). When not even one fits, every probe runs the whole model.
Logits: at most min(1024, 2^25 / vocab) tokens x vocab at a time (<= 128 MiB per fp32 tensor).
Device: made with `device` ("cuda"), the kept model's parts are moved there in fp32 as they are built, and the
probe's batches, kept block inputs and the source's reference live there; the identity checks still compare
the graph's (CPU) tensors.
"""

from __future__ import annotations

import io
import json
import math
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from kiln.calibration.data import length_batches
from kiln.calibration.metrics import kl_terms
from kiln.calibration.sensitivity import SensitivityTable
from kiln.kernels.errors import KilnError
from kiln.optimizer.lower import kv_cache_table, lower_tensors
from kiln.optimizer.measure.gate import BATCH_TOKENS
from kiln.passes.graph import ModelGraph
from kiln.runtime.attention import LayerRotaries
from kiln.runtime.kv_format import KvStream, resolve_kv_streams
from kiln.runtime.linear import onednn_fits, prepack_onednn
from kiln.runtime.model import build_block, place, scale_embedding
from kiln.runtime.model_weights import Weights
from kiln.runtime.paged_kv_cache import DEFAULT_BLOCK_SIZE, PagedKVCache
from kiln.runtime.spec import ModelSpec

MAX_BATCH_TOKENS = BATCH_TOKENS  # the gate's batches, so a probe sees the same padding
MAX_PREFIX_BYTES = 256 * 2**20
MAX_LOGITS = 2**25  # logits per chunk: 128 MiB fp32
EMBEDDING, HEAD = "embedding", "head"

_ABSENT, _PRESENT = object(), object()


class _Reads(Mapping):
    """A mapping that records every key looked up and what it held (or _ABSENT; _PRESENT where only its presence
    was asked), so a module built from it can later be checked against another mapping without rebuilding it."""

    def __init__(self, data: Mapping):
        self.data = data
        self.seen: dict[str, object] = {}

    def __getitem__(self, key):
        value = self.data.get(key, _ABSENT)
        self.seen[key] = value
        if value is _ABSENT:
            raise KeyError(key)
        return value

    def __contains__(self, key) -> bool:
        present = key in self.data  # without reading the tensor (a lazy store would load it)
        self.seen.setdefault(key, _PRESENT if present else _ABSENT)
        return present

    def __iter__(self) -> Iterator:
        raise TypeError("a runtime module must name the tensors it reads")  # so `seen` is all it depends on

    def __len__(self) -> int:
        return len(self.data)


def _holds(mapping: Mapping, key: str, seen: object) -> bool:
    if seen is _PRESENT:
        return key in mapping
    if seen is _ABSENT:
        return key not in mapping
    return mapping.get(key, _ABSENT) is seen


class _Part:
    """A built part of the model and what it was built from: the tensors (by identity) and format entries
    (by value: lowering makes new entries each time) it read."""

    def __init__(self, module, tensors: _Reads, formats: _Reads):
        self.module = module
        self.tensors, self.formats = tensors.seen, formats.seen

    def current(self, tensors: Mapping, formats: Mapping) -> bool:
        return (all(_holds(tensors, k, v) for k, v in self.tensors.items())
                and all(formats.get(k, _ABSENT) == v for k, v in self.formats.items()))


def _same_streams(a: tuple[KvStream, ...], b: tuple[KvStream, ...]) -> bool:
    def same(x: torch.Tensor | None, y: torch.Tensor | None) -> bool:
        return x is y or (x is not None and y is not None and x.dtype == y.dtype and x.shape == y.shape
                          and torch.equal(x, y))

    return len(a) == len(b) and all(
        (s.name, s.heads, s.dim, s.format, s.scaling) == (t.name, t.heads, t.dim, t.format, t.scaling)
        and same(s.scale, t.scale) and same(s.offset, t.offset) for s, t in zip(a, b, strict=True))


def _global_fields(spec: ModelSpec) -> tuple:
    """What the embedding and head parts are built from, besides tensors and formats."""
    return (spec.vocab_size, spec.hidden_size, spec.rms_norm_eps, spec.tie_word_embeddings, spec.embedding,
            spec.final_norm, spec.lm_head)


class _ProbeModel:
    """The runtime's modules (fp32) for one model state, swapped part by part to another state.

    `sync(spec, tensors, formats, kv_table)` (tensors and formats as `lower_tensors` gives them) rebuilds the
    parts that read a different tensor or format entry, or whose layer a structural pass replaced, and
    re-resolves the KV streams, and returns the first
    position the change reaches (0: the embedding or block 0, i: block i or its cache, len(layers): only the
    head) or None when nothing changed. `builds` counts every part built (EMBEDDING, HEAD, block index)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.onednn: bool | None = None  # prepacked linears, as the runtime's Engine keeps them (decided once)
        self.spec: ModelSpec | None = None
        self.parts: dict[str | int, _Part] = {}
        self.kv_streams: list[tuple[KvStream, ...]] = []
        self.builds: Counter = Counter()

    def sync(self, spec: ModelSpec, tensors: Mapping[str, torch.Tensor], formats: Mapping[str, Mapping],
             kv_table: Mapping) -> int | None:
        if spec is not self.spec:  # a structural pass rewrote the model: keep the parts it did not touch
            old = self.spec
            if old is None or _global_fields(old) != _global_fields(spec) or len(old.layers) != len(spec.layers):
                self.parts, self.kv_streams = {}, []
            else:  # layers are replaced, never mutated: an unchanged layer is the same object
                for i, (before, after) in enumerate(zip(old.layers, spec.layers, strict=True)):
                    if before is not after:
                        self.parts.pop(i, None)
            self.spec = spec
        layers = len(spec.layers)
        changed = []
        try:
            for key in (EMBEDDING, *range(layers), HEAD):
                part = self.parts.get(key)
                if part is None or not part.current(tensors, formats):
                    self.parts[key] = self._build(key, tensors, formats)
                    changed.append(0 if key == EMBEDDING else layers if key == HEAD else key)
            streams = resolve_kv_streams(spec, kv_table, tensors)
        except BaseException:
            self.spec = None  # half swapped (a part the runtime refused): the next state is built afresh
            raise
        if self.kv_streams:
            changed += [i for i, (old, new) in enumerate(zip(self.kv_streams, streams, strict=True))
                        if not _same_streams(old, new)]
        else:
            changed.append(0)
        self.kv_streams = streams
        return min(changed, default=None)

    def _build(self, key: str | int, tensors: Mapping, formats: Mapping) -> _Part:
        reads, entries = _Reads(tensors), _Reads(formats)
        weights = Weights(reads, entries, self.spec)
        spec = self.spec
        if key == EMBEDDING:
            module = weights.embedding()
        elif key == HEAD:
            module = (weights.norm(spec.final_norm), weights.linear(spec.lm_head).eval())
        else:
            module = build_block(spec.layers[key], weights).eval()
        if self.device.type == "cpu" and not isinstance(module, torch.Tensor):
            if self.onednn is None:  # the Engine's rule (runtime.linear.onednn_fits) on the whole model's linears
                self.onednn = onednn_fits(4 * sum(lin.in_features * lin.out_features for lin in spec.linears()))
            if self.onednn:
                for m in module if isinstance(module, tuple) else (module,):
                    prepack_onednn(m)
        if self.device.type != "cpu":
            module = (module.to(self.device) if isinstance(module, torch.Tensor)
                      else tuple(place(m, self.device, torch.float32) for m in module) if isinstance(module, tuple)
                      else place(module, self.device, torch.float32))
        self.builds[key] += 1
        return _Part(module, reads, entries)

    def block(self, index: int):
        return self.parts[index].module

    @property
    def embedding(self) -> torch.Tensor:
        return self.parts[EMBEDDING].module

    @property
    def head(self):
        return self.parts[HEAD].module  # (final norm, lm_head)


class _Probe:
    """Some calibration paragraphs in the runtime's batches (right-padded, as Engine.logits pads them), and
    the hidden states at the input of the kept blocks, valid for the model they were computed with."""

    def __init__(self, token_lists: list[list[int]], max_prefix_bytes: int | None, hidden: int, layers: int,
                 device: torch.device):
        self.lists = token_lists
        self.device = device
        self.batches = []
        for batch in length_batches(token_lists, MAX_BATCH_TOKENS):
            lengths = torch.tensor([len(token_lists[i]) for i in batch])
            T = int(lengths.max())
            tokens = torch.zeros(len(batch), T, dtype=torch.long)
            for row, i in enumerate(batch):
                tokens[row, : lengths[row]] = torch.as_tensor(token_lists[i], dtype=torch.long)
            positions = torch.arange(T).expand(len(batch), -1)
            # (indices, tokens, positions on the device; positions and validity on the host, where a paged cache
            # reads them: no device sync)
            host = (positions, positions < lengths.unsqueeze(1))
            self.batches.append((batch, tokens.to(device), positions.to(device), host))
        self.ropes: tuple[ModelSpec, list] | None = None
        # which block inputs are kept: the last block's output always (a head-only probe runs the head alone),
        # then every `stride`-th block input, as many as max_prefix_bytes holds (None: no bound)
        one = sum(tokens.numel() for _, tokens, _, _ in self.batches) * hidden * 4
        fit = layers if max_prefix_bytes is None else min(layers, max_prefix_bytes // one)
        stride = math.ceil((layers - 1) / (fit - 1)) if fit > 1 else layers
        self.kept = set(range(stride, layers, stride)) | ({layers} if fit else set())
        self.hidden: dict[int, list[torch.Tensor]] = {}  # block index -> [B, T, C] per batch

    def rotary(self, spec: ModelSpec) -> list:
        """Per batch, each layer's rotary tables (computed once per structure)."""
        if self.ropes is None or self.ropes[0] is not spec:
            rotary = LayerRotaries(spec.layers).to(self.device)
            self.ropes = (spec, [rotary(positions) for _, _, positions, _ in self.batches])  # on the device
        return self.ropes[1]

    def invalidate(self, first: int | None) -> None:
        """The model changed from `first` on: block inputs past it no longer hold."""
        if first is not None:
            self.hidden = {i: h for i, h in self.hidden.items() if i <= first}


class LogitKl:
    """`RuntimeRunner.logit_kl` (optimizer.measure.runner): KL of the final logits against the source.

    `builds` counts the model parts built so far (EMBEDDING, HEAD, block index), `blocks_run` the blocks run
    per batch of paragraphs: what a probe cost."""

    def __init__(self, source: ModelGraph, token_lists: Sequence[Sequence[int]],
                 max_prefix_bytes: int | None = MAX_PREFIX_BYTES, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.token_lists = [list(t) for t in token_lists if len(t) >= 2]
        self.max_prefix_bytes = max_prefix_bytes
        # The source as it is now, by reference (passes replace tensors, never mutate them): nothing is built
        # until the first call, so a build whose passes never ask pays nothing.
        tensors, formats = lower_tensors(source)
        self._source_state = (source.spec, tensors, formats, kv_cache_table(source))
        self._model = _ProbeModel(self.device)
        self._reference: list[torch.Tensor] = []  # per paragraph: the source's final hidden states [n - 1, C]
        self._source_head = None  # the source's lm_head (a QuantLinear)
        self._probe: _Probe | None = None
        self._last: float | None = None  # the value for the kept model, until it changes
        self.blocks_run = 0

    @property
    def builds(self) -> Counter:
        return self._model.builds

    # no_grad, not inference_mode: the kept modules hold the graph's tensors, which a lazy tensor store hands
    # out again to others (end-to-end tuning differentiates through them); inference tensors would refuse that
    @torch.no_grad()
    def __call__(self, graph: ModelGraph, paragraphs: int) -> float:
        if not self.token_lists:
            raise KilnError("sensitivity needs calibration text: pass --calib-data FILE")
        if paragraphs <= 0:
            raise KilnError(f"sensitivity paragraphs must be positive, got {paragraphs}")
        lists = self.token_lists[:paragraphs]
        if self._probe is None or len(self._probe.lists) != len(lists):
            spec = graph.spec
            self._probe = _Probe(lists, self.max_prefix_bytes, spec.hidden_size, len(spec.layers), self.device)
            self._last = None
        probe = self._probe
        if len(self._reference) < len(lists):
            self._extend_reference(len(lists))
        tensors, formats = lower_tensors(graph)
        first = self._sync(graph.spec, tensors, formats, kv_cache_table(graph))
        if first is None and self._last is not None:
            return self._last
        source_head = self._source_head
        norm, head = self._model.head
        chunk = max(1, min(1024, MAX_LOGITS // graph.spec.vocab_size))
        kl, count = torch.zeros((), dtype=torch.float64, device=self.device), 0  # read back once, at the end
        for batch, final in self._forward(probe, first):
            candidate = norm(final)
            ours = torch.cat([candidate[row, : len(lists[i]) - 1] for row, i in enumerate(batch)])
            theirs = torch.cat([self._reference[i] for i in batch])
            for start in range(0, ours.shape[0], chunk):
                p = torch.log_softmax(source_head(theirs[start: start + chunk]), dim=-1)
                q = torch.log_softmax(head(ours[start: start + chunk]), dim=-1)
                kl += kl_terms(p, q).sum()
            count += ours.shape[0]
        self._last = float(kl) / count
        return self._last

    # --- internals -----------------------------------------------------------------------------------------
    def _sync(self, spec: ModelSpec, tensors, formats, kv_table) -> int | None:
        """Swap the kept model to this state; the probe's block inputs past the first change go."""
        first = self._model.sync(spec, tensors, formats, kv_table)
        if first is not None:
            self._last = None
            self._probe.invalidate(first)
        return first

    def _extend_reference(self, paragraphs: int) -> None:
        """The source's final hidden states for paragraphs up to `paragraphs`: the kept model is swapped to
        the source, run (on the probe's batches when it is missing them all, priming its block inputs), and
        its head kept for the KL."""
        spec, tensors, formats, kv_table = self._source_state
        first = self._sync(spec, tensors, formats, kv_table)
        done = len(self._reference)
        whole = done == 0  # the first call: the probe's batches are these paragraphs
        probe = self._probe if whole else _Probe(self.token_lists[done:paragraphs], 0, spec.hidden_size,
                                                 len(spec.layers), self.device)
        norm, self._source_head = self._model.head
        computed = {}
        for batch, final in self._forward(probe, first if whole else 0):
            hidden = norm(final)
            for row, i in enumerate(batch):
                computed[i] = hidden[row, : len(probe.lists[i]) - 1].clone()
        self._reference.extend(computed[i] for i in range(len(probe.lists)))

    def _forward(self, probe: _Probe, first: int | None):
        """Yield (paragraph indices, last block's output [B, T, C]) per batch, for the kept model, from the
        kept block input nearest before `first` (None: nothing changed since the inputs were computed)."""
        model = self._model
        layers = len(model.spec.layers)
        start = max((i for i in probe.hidden if i <= (layers if first is None else first)), default=0)
        ropes = probe.rotary(model.spec)
        try:
            for b, (batch, tokens, positions, (host_positions, valid)) in enumerate(probe.batches):
                x = (scale_embedding(F.embedding(tokens, model.embedding), model.spec.embedding_scale) if start == 0
                     else probe.hidden[start][b])
                lengths = valid.sum(dim=1).tolist()
                for i in range(start, layers):
                    if i in probe.kept and i > start:
                        probe.hidden.setdefault(i, [None] * len(probe.batches))[b] = x
                    # a quantized cache's layer reads K/V back from a paged cache in its format, as Engine.logits
                    # does; a BF16 layer's pool holds the fp32 values as written (runtime.kv_format), so it
                    # attends to them directly
                    streams = model.kv_streams[i]
                    cache = None
                    if any(s.codec.quantized for s in streams):
                        cache = PagedKVCache([streams], sum(-(-n // DEFAULT_BLOCK_SIZE) for n in lengths),
                                             device=probe.device)
                        for row in range(len(batch)):
                            cache.add_sequence(row)
                        cache.prepare(list(range(len(batch))), host_positions, valid)
                    x = model.block(i)(x, ropes[b][i], positions, cache, 0)
                    self.blocks_run += 1
                if layers in probe.kept and start < layers:
                    probe.hidden.setdefault(layers, [None] * len(probe.batches))[b] = x
                yield batch, x
        except BaseException:
            probe.hidden = {}  # some batches' inputs may be missing
            raise


def render_heatmap(table: SensitivityTable, chosen: Mapping[str, str] | None = None, title: str = "") -> bytes:
    """PNG bytes: one row per group, one column per option, colour log10(KL); the chosen option is boxed.

    Entries a group was not measured in are blank; BF16 (KL 0) is drawn at the colour scale's floor.
    """
    import matplotlib  # lazy: slow to import, and only this picture needs it

    matplotlib.use("Agg")  # before pyplot: no display
    import matplotlib.pyplot as plt  # lazy: as matplotlib

    groups, options = table.groups(), table.options()
    if not groups or not options:
        raise KilnError("the sensitivity table is empty; nothing to draw")
    positive = [v for per in table.losses.values() for v in per.values() if v > 0]
    floor = math.log10(min(positive)) - 0.5 if positive else -8.0
    grid = np.full((len(groups), len(options)), np.nan)
    for r, g in enumerate(groups):
        for c, o in enumerate(options):
            v = table.losses[g].get(o)
            if v is not None:
                grid[r, c] = math.log10(v) if v > 0 else floor
    fig, ax = plt.subplots(figsize=(1.6 + 1.25 * len(options), 1.2 + 0.32 * len(groups)), dpi=110)
    cmap = matplotlib.colormaps["magma_r"].with_extremes(bad="#eeeeee")
    image = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap=cmap)
    ax.set_xticks(range(len(options)), options, rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(groups)), groups, fontsize=7)
    for r, g in enumerate(groups):
        for c, o in enumerate(options):
            v = table.losses[g].get(o)
            if v is None:
                continue
            text = "0" if v == 0 else f"{v:.1e}"
            shade = grid[r, c] > (np.nanmin(grid) + np.nanmax(grid)) / 2
            ax.text(c, r, text, ha="center", va="center", fontsize=6, color="white" if shade else "black")
            if chosen and chosen.get(g) == o:
                ax.add_patch(plt.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="#00b050", lw=2))
    bar = fig.colorbar(image, ax=ax, fraction=0.04, pad=0.02)
    bar.set_label(f"log10 {table.metric} (nats/token)", fontsize=8)
    ax.set_title(title or f"sensitivity: {table.metric}, one group at a time ({table.tokens} tokens)"
                 + ("; box = chosen" if chosen else ""), fontsize=9)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def precision_files(precision: Mapping | None) -> dict[str, bytes]:
    """The artifact files a precision pass adds: sensitivity.json (the table and every group's choice) and
    sensitivity.png (the heatmap). Nothing when no precision pass ran."""
    if not precision:
        return {}
    table = SensitivityTable.from_json(precision["sensitivity"])
    chosen = {g: entry["option"] for g, entry in precision["groups"].items()}
    document = {"pass": precision["pass"], "sensitivity": precision["sensitivity"], "chosen": chosen,
                "effective_bits": precision["effective_bits"]}
    files = {"sensitivity.json": (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()}
    if table.groups():
        files["sensitivity.png"] = render_heatmap(
            table, chosen, f"{precision['pass']}: KL per group and format ({table.tokens} calibration tokens); "
                           f"box = chosen, {precision['effective_bits']:.3f} effective bits")
    return files


def precision_markdown(precision: Mapping) -> list[str]:
    """report.md lines: every linear's final format and why it got it, from the manifest's "precision"."""
    policy = precision.get("policy", {})
    lines = ["## Precision per layer", ""]
    head = (f"`{precision['pass']}`: {precision['effective_bits']:.3f} effective bits per weight "
            f"({precision['weight_bytes']} bytes of weights and scales for {precision['weights']} weights)")
    if policy.get("kind") == "budget":
        head += f"; budget {policy['budget_bits']:.3f} bits ({policy['budget_bytes']} bytes)"
        if precision["weight_bytes"] > policy["budget_bytes"]:
            head += ", exceeded because the gate's back-off promoted groups"
    lines += [head + ".", "",
              (f"Sensitivity: {precision['sensitivity']['metric']} on {precision['sensitivity']['tokens']} "
               "calibration tokens, one group at a time (`sensitivity.json`, heatmap `sensitivity.png`)."), ""]
    experts = precision.get("experts") or {}
    if experts.get("total"):
        lines += [f"Routed experts quantized: {experts.get('quantized', 0)} of {experts['total']}"
                  + (f"; {experts['without_calibration_tokens']} saw no calibration tokens (weight-only "
                     "statistics)" if experts.get("without_calibration_tokens") else "") + ".", ""]
    lines += ["| module | group | format | KL | why |", "|---|---|---|---:|---|"]
    for name, entry in precision["linears"].items():
        kl = precision["groups"][entry["group"]]["kl"]
        lines.append(f"| {name} | {entry['group']} | {entry['option']} | {kl:.2e} | {entry['reason']} |")
    for name, why in precision.get("kept", {}).items():
        lines.append(f"| {name} | | source precision | | {why} |")
    return lines
