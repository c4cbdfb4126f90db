"""Sensitivity from one gradient pass: the KL each candidate (a group of linears in some format) would cost,
estimated to second order instead of measured by one forward pass per probe (`LogitKl`). This is what
ModelOpt's auto_quantize does with its gradient scores; a 30-layer model has hundreds of probes, each a
forward pass of up to the whole model and two lm_heads, while this costs one forward and backward pass per
chunk of candidates.

For a small change Δy of the outputs of some linears, the KL from the model's next-token distribution p to
the changed model's is, to second order, ½ E_{t~p}[(∇_y log p_t · Δy)²] (the Fisher information of p in the
direction Δy; the first-order term vanishes at p). Per calibration position a label t is drawn from the
model's own distribution (seeded: every chunk draws the same labels), the gradient g of Σ log p_t reaches
every linear's output, and each candidate's Δy = candidate(x) - linear(x) is computed on the same inputs x:

    est[key] = ½ Σ_positions (Σ_{linears of key} g · Δy)² / positions

The linears of a key are summed per row within one module (q/k/v of an attention; gate/up/down of one
expert, whose rows are that expert's tokens); different experts of one key add their squares separately.

The gradient at position i also carries the labels of later positions; those cross terms have mean zero
over the drawn labels and only add noise. The estimate is a linearisation (FP4's errors are not small) and
noisier than a measured probe, so precision passes measure where that is affordable and estimate beyond
(`PrecisionPass.sensitivity_method`).

Device: made with `device` ("cuda"), the model and the candidates' modules are moved there in fp32 and the
sweeps run there; the labels are drawn on the CPU from the same seeds, so both devices score the same labels.

Memory: the model in fp32 with one batch's autograd activations (`batch_tokens` per batch), the chunk's
candidate weights in fp32 (at most `max_candidate_bytes`), and the hooked linears' inputs for one batch.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import torch

from kiln.calibration import progress
from kiln.calibration.data import length_batches
from kiln.kernels.errors import KilnError
from kiln.optimizer.lower import lower_tensors
from kiln.optimizer.measure.calibration_session import _Batch, _RecordingWeights
from kiln.passes.graph import ModelGraph, QuantizedWeight
from kiln.runtime.linear import QuantLinear
from kiln.runtime.model import Transformer, place
from kiln.runtime.model_weights import Weights

BATCH_TOKENS = 256  # an autograd batch: SmolLM2's activations for 256 tokens are ~0.5 GB
MAX_CANDIDATE_BYTES = 256 * 2**20  # fp32 candidate weights held per sweep
SEED = 0

Candidates = Mapping[Hashable, Mapping[str, QuantizedWeight | None]]  # key -> linear -> its quantized weight


def _swept(graph: ModelGraph, candidates: Candidates, budget: int) -> list[list[Hashable]]:
    """The candidate keys in chunks whose fp32 weights fit in `budget` bytes (a bigger one is a chunk alone)."""
    chunks: list[list[Hashable]] = [[]]
    held = 0
    for key, state in candidates.items():
        size = sum(4 * graph.linears[n].out_features * graph.linears[n].in_features for n in state)
        if chunks[-1] and held + size > budget:
            chunks.append([])
            held = 0
        chunks[-1].append(key)
        held += size
    return [c for c in chunks if c]


class FisherKl:
    """`RuntimeRunner.estimated_kl`: ½ E[(g · Δy)²] per candidate, from gradients of the graph as it stands."""

    def __init__(self, token_lists: Sequence[Sequence[int]], batch_tokens: int = BATCH_TOKENS,
                 max_candidate_bytes: int = MAX_CANDIDATE_BYTES, seed: int = SEED,
                 device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.token_lists = [list(t) for t in token_lists if len(t) >= 2]
        self.batch_tokens = batch_tokens
        self.max_candidate_bytes = max_candidate_bytes
        self.seed = seed
        self.sweeps = 0  # forward + backward passes over the paragraphs, for tests and logs

    def __call__(self, graph: ModelGraph, candidates: Candidates, paragraphs: int) -> dict[Hashable, float]:
        if not self.token_lists:
            raise KilnError("sensitivity needs calibration text: pass --calib-data FILE")
        if paragraphs <= 0:
            raise KilnError(f"sensitivity paragraphs must be positive, got {paragraphs}")
        unknown = sorted({n for state in candidates.values() for n in state} - set(graph.linears))
        if unknown:
            raise KilnError(f"estimated KL: the model has no linear named {unknown[0]}")
        lists = self.token_lists[:paragraphs]
        batches = [_Batch([lists[i] for i in b], self.device) for b in length_batches(lists, self.batch_tokens)]
        positions = sum(len(t) - 1 for t in lists)
        tensors, formats = lower_tensors(graph)
        weights = _RecordingWeights(tensors, formats, graph.spec)
        model = self._place(Transformer(graph.spec, weights=weights).eval())  # weights.built: the moved modules
        specs = {lin.name: lin for lin in graph.spec.linears()}
        scores: dict[Hashable, float] = dict.fromkeys(candidates, 0.0)
        chunks = _swept(graph, candidates, self.max_candidate_bytes)
        with progress.stage("sensitivity: gradient sweeps", total=len(chunks) * len(batches), unit="batches") as task:
            for chunk in chunks:
                modules = {key: {n: self._place(m) for n, m in self._build(graph, specs, candidates[key]).items()}
                           for key in chunk}
                for index, batch in enumerate(batches):
                    for key, value in self._sweep(model, weights.built, modules, batch, index).items():
                        scores[key] += value
                    task.advance()
                del modules
                self.sweeps += 1
        return {key: value / positions for key, value in scores.items()}

    def _place(self, module: torch.nn.Module) -> torch.nn.Module:
        return module if self.device.type == "cpu" else place(module, self.device, torch.float32)

    @staticmethod
    def _build(graph: ModelGraph, specs: Mapping, state: Mapping[str, QuantizedWeight | None]) -> dict[str, QuantLinear]:
        """The runtime's modules for one candidate's linears (their weights dequantized to fp32 once)."""
        before = {n: graph.linears[n].quant for n in state}
        try:
            for n, q in state.items():
                graph.linears[n].quant = q
            tensors, formats = lower_tensors(graph)
            weights = Weights(tensors, formats, graph.spec)
            return {n: weights.linear(specs[n]) for n in state}
        finally:
            for n, q in before.items():
                graph.linears[n].quant = q

    def _sweep(self, model: Transformer, built: Mapping[str, QuantLinear], modules: Mapping[Hashable, Mapping],
               batch: _Batch, index: int) -> dict[Hashable, float]:
        """One forward and backward pass over one batch: ½ Σ_positions (Σ g · Δy)² per candidate key."""
        by_linear: dict[str, list[tuple[Hashable, QuantLinear]]] = {}
        for key, per in modules.items():
            for name, module in per.items():
                by_linear.setdefault(name, []).append((key, module))
        dots: dict[tuple[Hashable, str], torch.Tensor] = {}  # (key, the linear's parent module) -> g·Δy per row

        def hook(name: str):
            def forward_hook(_module, args, out):
                x, y = args[0].detach(), out.detach()

                def grad_hook(g):
                    with torch.no_grad():
                        for key, candidate in by_linear[name]:
                            d = (g * (candidate(x) - y)).sum(-1)
                            slot = (key, name.rsplit(".", 1)[0])
                            dots[slot] = dots[slot] + d if slot in dots else d
                out.register_hook(grad_hook)
            return forward_hook

        def needs_grad(_module, args):
            return (args[0].detach().requires_grad_(True), *args[1:])

        handles = [built[name].register_forward_hook(hook(name)) for name in by_linear]
        handles.append(model.blocks[0].register_forward_pre_hook(needs_grad))
        try:
            with torch.enable_grad():
                logits = model(batch.tokens.to(self.device), batch.positions)
                scored = batch.mask.clone()
                scored[torch.arange(len(scored), device=scored.device), batch.mask.sum(1) - 1] = False  # the last token predicts nothing
                logp = torch.log_softmax(logits[scored], dim=-1)
                generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
                labels = torch.multinomial(logp.detach().exp().cpu(), 1, generator=generator).to(logp.device)
                logp.gather(-1, labels).sum().backward()
        finally:
            for handle in handles:
                handle.remove()
        # g is zero where nothing is scored (padding, each sequence's last token), so every row may be summed
        out: dict[Hashable, float] = {}
        for (key, _), d in dots.items():
            out[key] = out.get(key, 0.0) + 0.5 * float((d ** 2).sum())
        return out
