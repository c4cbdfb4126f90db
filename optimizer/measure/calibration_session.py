"""The calibration sessions of `ModelRunner.session` (optimizer.measure.runner): the runtime's own modules run over
the calibration tokens, one block at a time, as the graph stands at that moment.

    session = RuntimeCalibrator(calibration_tokens).session(graph)   # RuntimeRunner.session(graph)
    session.observe(["model.layers.0.self_attn.q_proj", ...], callback)   # callback(name, x [tokens, K])

A session holds the hidden states of every calibration token at the input of one block (plus their
positions). Observing linears of block L first runs blocks position..L-1 forward, each rebuilt from the
graph as it is now, i.e. with whatever a pass has already quantized; so a pass that quantizes block by block
calibrates each block on the outputs of the quantized blocks before it (sequential calibration), and
within a block it can quantize q/k/v, then observe o_proj's inputs through the quantized q/k/v, and so on.
Observing an earlier block than the session's position, or after a block the hidden states went through
has changed (a tensor or quant annotation replaced), starts again from the embeddings.

    objective = session.distillation(weights, norms)   # end-to-end tuning (calibration.tuning)
    objective.loss(step)  # KL(source || graph with `weights`/`norms` swapped in) on one batch; runs backward

The source for distillation is the graph as it stood when the session was created (before the pass).

    checkpoint = session.checkpoint()   # the hidden states at the input of the block the session stands at
    later.resume(checkpoint)            # another session on the same text starts there, not at the embedding

A back-off attempt of weight quantization restores the blocks an earlier attempt calibrated and resumes at the
first block it recalibrates (passes.calibration_cache.CalibrationCache); `resume` refuses a checkpoint the graph no
longer matches (the blocks before it compute with other tensors or annotations, compared by identity).

Device: a session made with `device` ("cuda") keeps the hidden states there and runs each block there in fp32
(moved as it is built; the graph's tensors stay where they are); the callback gets inputs on that device.
Distillation runs there too: both models are moved whole, and the tuned parameters must already live there
(passes.end_to_end_tuning.tune_end_to_end makes them on `session.device`).

Memory: the hidden states of the calibration set ([tokens, hidden] fp32) plus one block's modules (built from
the graph's lazily lowered tensors, so only that block is read), and the embedding in its source dtype while
the hidden states restart from it; the observers decide what they keep of each batch (Hessians, not
activations). Distillation is the exception: it holds the whole model twice (below). The callback sees only real
tokens: padding positions are dropped (3-D inputs) or zeroed before an MoE block routes them (expert inputs
are 2-D), and observers skip all-zero rows.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from kiln.calibration.data import FORWARD_BATCH_TOKENS, forward_batch_tokens, length_batches
from kiln.calibration.metrics import kl_terms
from kiln.kernels.errors import KilnError
from kiln.optimizer.lower import lower_tensors
from kiln.passes.graph import ModelGraph
from kiln.runtime.attention import LayerRotaries
from kiln.runtime.linear import QuantLinear
from kiln.runtime.model import Block, Transformer, build_block, place, scale_embedding
from kiln.runtime.model_weights import Weights

Callback = Callable[[str, torch.Tensor], None]
MICRO_BATCH_TOKENS = 512  # distillation's autograd batch: SmolLM2's activations for 512 tokens are ~1 GB


class RuntimeCalibrator:
    """The sessions behind `RuntimeRunner.session` (optimizer.measure.runner).

    `observe` runs over the first `observe_sequences` token lists (None: all): Hessians and ranges settle
    within a few hundred paragraphs. Distillation, which fits many more parameters, uses every token list.
    """

    def __init__(self, token_lists: Sequence[Sequence[int]], max_batch_tokens: int = FORWARD_BATCH_TOKENS,
                 observe_sequences: int | None = None, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.token_lists = [list(t) for t in token_lists if len(t) > 0]
        if not self.token_lists:
            raise KilnError("calibration needs at least one non-empty token list")
        if observe_sequences is not None and observe_sequences < 1:
            raise KilnError(f"observe_sequences must be positive, got {observe_sequences}")
        self.max_batch_tokens = max_batch_tokens
        self.observe_sequences = observe_sequences

    def session(self, graph: ModelGraph) -> RuntimeCalibrationSession:
        return RuntimeCalibrationSession(graph, self.token_lists, self.max_batch_tokens, self.observe_sequences,
                                         self.device)


class _RecordingWeights(Weights):
    """Weights that remember which runtime module each linear and norm became, so hooks can find them."""

    def __init__(self, *args):
        super().__init__(*args)
        self.built: dict[str, QuantLinear] = {}
        self.norms: dict[str, torch.nn.Module] = {}

    def linear(self, lin, packable: bool = True):
        module = super().linear(lin, packable)
        self.built[lin.name] = module
        return module

    def norm(self, name: str):
        module = super().norm(name)
        self.norms[name] = module
        return module


class _Same:
    """Compares by identity (tensors' == is elementwise)."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other) -> bool:
        return isinstance(other, _Same) and self.obj is other.obj

    __hash__ = None


class _Batch:
    def __init__(self, token_lists: list[list[int]], device: torch.device | None = None):
        lengths = [len(t) for t in token_lists]
        T = max(lengths)
        self.tokens = torch.zeros(len(token_lists), T, dtype=torch.long)  # on the CPU, beside the embedding
        for row, ids in enumerate(token_lists):
            self.tokens[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        self.positions = torch.arange(T, device=device).expand(len(token_lists), -1)
        self.mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).to(device)  # [B, T] real tokens
        self.count = sum(lengths)  # real tokens, counted on the host
        self.hidden: torch.Tensor | None = None  # [B, T, C] at the session's position


class HiddenCheckpoint:
    """A session's hidden states at the input of block `position` (one tensor per batch, on the session's
    device) and the fingerprints of the blocks they went through (RuntimeCalibrationSession.checkpoint).
    `faithful`: they are what those blocks compute from the embedding; False when the session had taken an
    earlier attempt's states as they were (a resume that was not exact), whatever the fingerprints say."""

    __slots__ = ("faithful", "hidden", "position", "ran", "tokens")

    def __init__(self, position: int, hidden: list[torch.Tensor], ran: dict, tokens: list[torch.Tensor],
                 faithful: bool = True):
        self.position, self.hidden, self.ran, self.tokens = position, hidden, ran, tokens
        self.faithful = faithful

    @property
    def nbytes(self) -> int:
        return sum(h.numel() * h.element_size() for h in self.hidden)


class RuntimeCalibrationSession:
    def __init__(self, graph: ModelGraph, token_lists: list[list[int]], max_batch_tokens: int,
                 observe_sequences: int | None = None, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.graph = graph
        self.spec = graph.spec  # the structure when the session starts: the distillation teacher's
        self.all_token_lists = token_lists  # distillation
        token_lists = token_lists[:observe_sequences] if observe_sequences else token_lists
        # blocks run batch by batch: narrower batches for wide blocks bound their activations
        widest = max((max(lin.in_features, lin.out_features) for lin in graph.linears.values()
                      if lin.layer is not None), default=graph.spec.hidden_size)
        self.batch_tokens = forward_batch_tokens(widest, max_batch_tokens)
        self.batches = [_Batch([token_lists[j] for j in batch], self.device)
                        for batch in length_batches(token_lists, self.batch_tokens)]
        self._rotary: tuple | None = None  # (spec, its LayerRotaries): blocks run as the graph's spec says now
        self.position: int | None = None  # hidden states are at the input of this block
        self._ran: dict[int, tuple[_Same, ...]] = {}  # what each block held when the hidden states went through
        self._faithful = True  # the hidden states are what those blocks compute (HiddenCheckpoint.faithful)
        self.source = lower_tensors(graph)  # (tensors, formats) before the pass: the distillation teacher
        self.tokens = sum(b.count for b in self.batches)

    # --- public --------------------------------------------------------------------------------------------
    def observe(self, linears: Sequence[str], callback: Callback) -> None:
        """Feed callback(name, x [tokens, in_features]) the inputs of `linears` (all in one block, or the
        lm_head) over the whole calibration set, with every earlier block as the graph stands now."""
        if not linears:
            return
        unknown = [n for n in linears if n not in self.graph.linears]
        if unknown:
            raise KilnError(f"calibration: unknown linear(s) {', '.join(unknown[:3])}")
        layers = {self.graph.linears[n].layer for n in linears}
        if len(layers) != 1:
            raise KilnError(f"calibration observes one block at a time; got linears of blocks {sorted(map(str, layers))}")
        (layer,) = layers
        target = len(self.spec.layers) if layer is None else layer
        self._seek(target)
        if target == len(self.spec.layers):
            self._run_head(linears, callback)
        else:
            self._run_block(target, linears, callback, keep_output=False)

    def distillation(self, weights: Mapping[str, Callable[[], torch.Tensor]],
                     norms: Mapping[str, torch.nn.Parameter], max_batch_tokens: int = 4096,
                     extra_token_lists: Sequence[Sequence[int]] = ()) -> Distillation:
        """A differentiable KL objective: the graph as it stands, with the linears in `weights` computing with
        weights[name]() and the norms (or the embedding) in `norms` (tensor name -> weight) replaced, against
        the source, on every calibration paragraph and `extra_token_lists`."""
        return Distillation(self, weights, norms, max_batch_tokens, extra_token_lists)

    def checkpoint(self) -> HiddenCheckpoint | None:
        """The hidden states where the session stands (the input of block `position`; none yet: None), with what
        every block before computed with. On the CPU held by reference (the session replaces hidden states, never
        changes them: this costs the memory they would otherwise free); from another device copied to the CPU,
        so kept checkpoints do not hold accelerator memory."""
        if self.position is None:
            return None
        hidden = [b.hidden if b.hidden.device.type == "cpu" else b.hidden.to("cpu") for b in self.batches]
        return HiddenCheckpoint(self.position, hidden, dict(self._ran), [b.tokens for b in self.batches],
                                self._faithful)

    def resume(self, checkpoint: HiddenCheckpoint, exact: bool = True) -> bool:
        """Stand at `checkpoint` (e.g. from an earlier session on the same text) instead of replaying the blocks
        before it, when this session's batches are its and (`exact`) the graph still holds exactly what those
        blocks computed with (the fingerprints, by identity); False, and nothing changed, otherwise. Not `exact`:
        whatever the blocks before hold now, the hidden states are taken as theirs (a back-off that
        recalibrates a block on the inputs an earlier attempt gave it); the session is then not faithful until it
        starts again from the embedding. `exact` takes only a faithful checkpoint."""
        if len(checkpoint.tokens) != len(self.batches) or any(
                not torch.equal(t, b.tokens) for t, b in zip(checkpoint.tokens, self.batches, strict=True)):
            return False
        if exact and (not checkpoint.faithful or any(self._fingerprint(i) != checkpoint.ran.get(i)
                                                     for i in range(-1, checkpoint.position))):
            return False
        for b, hidden in zip(self.batches, checkpoint.hidden, strict=True):
            b.hidden = hidden.to(self.device)  # (a copy back to the session's device; the same tensor on the CPU)
        self.position = checkpoint.position
        self._ran = (dict(checkpoint.ran) if exact else
                     {i: self._fingerprint(i) for i in range(-1, checkpoint.position)})
        self._faithful = exact
        return True

    # --- internals -----------------------------------------------------------------------------------------
    def _seek(self, layer: int) -> None:
        # The stored hidden states are valid while every block they went through is as it was when it ran
        # (compared by identity: passes replace tensors and quant annotations, never mutate them).
        if self.position is not None and (layer < self.position or any(
                self._fingerprint(i) != self._ran[i] for i in range(-1, self.position))):
            self.position = None
        if self.position is None:
            embed = self.graph.tensors[self.graph.embedding]  # source dtype: rows are widened after the lookup
            for b in self.batches:
                rows = F.embedding(b.tokens, embed).to(self.device, torch.float32)
                b.hidden = scale_embedding(rows, self.graph.spec.embedding_scale) * b.mask.unsqueeze(-1)
            del embed
            self.position = 0
            self._ran = {-1: self._fingerprint(-1)}
            self._faithful = True
        while self.position < layer:
            self._ran[self.position] = self._fingerprint(self.position)
            self._run_block(self.position, (), None, keep_output=True)
            self.position += 1

    def _fingerprint(self, index: int) -> tuple[_Same, ...]:
        """What block `index` (-1: the embedding) computes with: its tensors' entries in the graph's store
        (replaced, never mutated; compared without reading them) and its quant annotations."""
        entry = self.graph.tensors.entry
        if index < 0:
            return (_Same(entry(self.graph.embedding)),)
        layer = self.graph.spec.layers[index]  # a structural pass may have rewritten it (compared by identity)
        names = [*layer.attention.linears.values(), *layer.mlp.linears.values(),
                 *(ls for expert in layer.mlp.experts for ls in expert.values())]
        parts = [_Same(layer), *(_Same(entry(n)) for n in layer.norms)]
        for ls in names:
            lin = self.graph.linears[ls.name]
            parts += [_Same(entry(lin.weight_name)), _Same(lin.quant), _Same(entry(f"{lin.name}.bias"))]
        return tuple(parts)

    def _weights(self) -> _RecordingWeights:
        """The graph as it stands, lowered lazily: building one block reads that block's tensors only."""
        tensors, formats = lower_tensors(self.graph)
        return _RecordingWeights(tensors, formats, self.graph.spec)

    def _block(self, index: int, weights: _RecordingWeights) -> Block:
        return self.to_device(build_block(self.graph.spec.layers[index], weights).eval())

    def to_device(self, module: torch.nn.Module) -> torch.nn.Module:
        """`module` on the session's device in fp32 (on the CPU, as built)."""
        return module if self.device.type == "cpu" else place(module, self.device, torch.float32)

    def rotary(self, positions: torch.Tensor) -> list:
        spec = self.graph.spec
        if self._rotary is None or self._rotary[0] is not spec:
            self._rotary = (spec, self.to_device(LayerRotaries(spec.layers)))
        return self._rotary[1](positions)

    @torch.inference_mode()
    def _run_block(self, index: int, linears: Sequence[str], callback: Callback | None, keep_output: bool) -> None:
        weights = self._weights()
        block = self._block(index, weights)
        current: dict = {}
        # Without an output to keep, a batch's forward stops once every observed linear has had its input
        # (q/k/v: right after the norm; o_proj: before the MLP); an MoE expert no token reached never stops it.
        stop_after = None if keep_output else set(linears)
        handles = [self._hook(weights.built[n], n, current, callback, stop_after) for n in linears]
        mask_handle = block.mlp.register_forward_pre_hook(lambda m, args: (args[0] * current["mask"],))
        try:
            for b in self.batches:
                current["mask"] = b.mask.unsqueeze(-1).to(b.hidden.dtype)
                current["bool_mask"] = b.mask
                current["seen"] = set()
                try:
                    out = block(b.hidden, self.rotary(b.positions)[index], b.positions, None, index)
                except _Observed:
                    continue
                if keep_output:
                    b.hidden = out * current["mask"]
        finally:
            for h in handles:
                h.remove()
            mask_handle.remove()

    @torch.inference_mode()
    def _run_head(self, linears: Sequence[str], callback: Callback) -> None:
        weights = self._weights()
        norm = self.to_device(weights.norm(self.graph.spec.final_norm))
        head = weights.linear(self.graph.spec.lm_head)
        for b in self.batches:
            callback(self.graph.spec.lm_head.name, norm(b.hidden)[b.mask])
        del head

    @staticmethod
    def _hook(module: QuantLinear, name: str, current: dict, callback: Callback, stop_after: set[str] | None):
        def pre_hook(_module, args):
            x = args[0]
            x = x[current["bool_mask"]] if x.dim() == 3 else x.reshape(-1, x.shape[-1])
            callback(name, x)
            if stop_after is not None:
                current["seen"].add(name)
                if current["seen"] >= stop_after:
                    raise _Observed

        return module.register_forward_pre_hook(pre_hook)


class _Observed(Exception):
    """Raised by the last observation hook of a batch: the rest of the block's forward is not needed."""



class _TunedLinear(torch.nn.Module):
    """A runtime linear whose weight comes from a callable (a latent weight on its format's grid); its
    activation quantizer, if any, gets a straight-through gradient."""

    def __init__(self, base: QuantLinear, weight: Callable[[], torch.Tensor]):
        super().__init__()
        self.weight_fn = weight
        self.bias = base.bias
        self.input_quantizer = base.input_quantizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        transform = self.input_quantizer
        if transform is not None:
            x = transform.rotate(x)  # linear: differentiated exactly
            if transform.quantize is not None:
                with torch.no_grad():
                    q = transform.quantize(x)
                x = x + (q - x).detach()
        return F.linear(x, self.weight_fn(), self.bias)


class Distillation:
    """KL(source || student) per batch of calibration tokens, the student being the runtime's modules built
    from the graph as it stands with tuned weights and norms swapped in. Batches are shuffled once (seeded)
    and cycled; the source's last hidden states are computed once per batch and kept.

    Memory: both models whole in fp32 (with the student's activations for one batch) and [tokens, hidden] for
    the source: this is for models that fit on the machine, unlike `observe`, which needs one block at a time.
    End-to-end tuning (the FP4 recipes' tune_steps) of a model larger than RAM (an 8B model: 64 GB) is out of
    reach; the streaming recipes (fp8-weights, fp8) do not tune."""

    def __init__(self, session: RuntimeCalibrationSession, weights: Mapping[str, Callable[[], torch.Tensor]],
                 norms: Mapping[str, torch.nn.Parameter], max_batch_tokens: int,
                 extra_token_lists: Sequence[Sequence[int]] = ()):
        self.session = session
        spec = session.spec
        tokens = [*session.all_token_lists, *(list(t) for t in extra_token_lists)]
        groups = length_batches(tokens, max_batch_tokens)
        random.Random(0).shuffle(groups)
        # a step's batch runs as micro-batches of at most MICRO_BATCH_TOKENS padded tokens (gradients add up),
        # so the autograd activations stay small whatever the step's batch
        self.device = device = session.device
        self.batches = []
        for g in groups:
            rows = max(1, MICRO_BATCH_TOKENS // max(len(tokens[i]) for i in g))
            self.batches.append([_Batch([tokens[i] for i in g[k: k + rows]], device)
                                 for k in range(0, len(g), rows)])
        self._tokens = [sum(m.count for m in micro) for micro in self.batches]
        # the source's last hidden states, not its log-probabilities: [tokens, hidden] is vocab/hidden times
        # smaller, and the lm_head product is cheap to redo
        self._teacher_hidden: list[list[torch.Tensor] | None] = [None] * len(self.batches)

        source_tensors, source_formats = session.source
        self.teacher = session.to_device(Transformer(spec, weights=_RecordingWeights(source_tensors, source_formats, spec)))
        # the student is the graph as it stands now, whose structure a pass may have rewritten (MLA conversion)
        student_spec = session.graph.spec
        tensors, formats = lower_tensors(session.graph)
        student_weights = _RecordingWeights(tensors, formats, student_spec)
        # moved before the swaps below: place() replaces the parameters it moves, and the tuned ones must stay
        self.student = session.to_device(Transformer(student_spec, weights=student_weights))
        missing = sorted(set(weights) - set(student_weights.built)) + sorted(
            set(norms) - set(student_weights.norms) - {student_spec.embedding})
        if missing:
            raise KilnError(f"distillation: the model has no linear or norm named {', '.join(missing[:3])}")
        for name, base in student_weights.built.items():
            # every linear: straight-through activation quantizers keep gradients flowing to earlier layers
            fn = weights.get(name, lambda weight=base.weight: weight)
            _replace_module(self.student, base, _TunedLinear(base, fn))
        for name, param in norms.items():
            if name == student_spec.embedding:  # the embedding rows, and the lm_head when it reads them (tied)
                self.student.embed = param
                if session.graph.linears[student_spec.lm_head.name].tied_to == name:
                    self.student.lm_head.weight_fn = lambda embed=param: embed
                continue
            module = student_weights.norms[name]
            del module.weight
            module.weight = param

    def __len__(self) -> int:
        return len(self.batches)

    def batch_tokens(self, step: int) -> int:
        """The real (non-padding) tokens of step `step`'s batch."""
        return self._tokens[step % len(self.batches)]

    def loss(self, step: int) -> float:
        """The mean per-token KL of this step's batch; its gradient is accumulated (backward is run here,
        micro-batch by micro-batch), so the caller zeroes gradients before and steps after."""
        i = step % len(self.batches)
        micro = self.batches[i]
        if self._teacher_hidden[i] is None:
            with torch.inference_mode():
                self._teacher_hidden[i] = [self.teacher.hidden(b.tokens.to(self.device), b.positions)[b.mask]
                                           for b in micro]
        total = 0.0
        for b, hidden in zip(micro, self._teacher_hidden[i], strict=True):
            with torch.no_grad():
                target = torch.log_softmax(self.teacher.lm_head(hidden), dim=-1)
            logp = torch.log_softmax(self.student(b.tokens.to(self.device), b.positions), dim=-1)[b.mask]
            value = kl_terms(target, logp).sum() / self._tokens[i]
            if value.requires_grad:  # (nothing to tune: a plain measurement)
                value.backward()
            total += float(value.detach())
        return total


def _replace_module(root: torch.nn.Module, old: torch.nn.Module, new: torch.nn.Module) -> None:
    for parent in root.modules():
        for attr, child in parent.named_children():
            if child is old:
                setattr(parent, attr, new)
                return
    raise KilnError("distillation: a linear to tune is not part of the model")
