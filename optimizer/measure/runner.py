"""`PassContext.runner`: what passes ask of the model (passes.base.ModelRunner), answered by the runtime's own
modules on the calibration tokens.

    runner = RuntimeRunner(source_graph, calibration_tokens)
    runner.session(graph)            observe linears' inputs block by block; distillation (optimizer.measure.calibration_session)
    runner.capture_kv(graph)         K/V cache activations (optimizer.measure.kv_capture.KvCapture)
    runner.logit_kl(graph, n)        KL(source || graph) of the final logits on n paragraphs (optimizer.measure.logit_kl:
                                     one kept model; a probe rebuilds and reruns only what it changed)
    runner.estimated_kl(graph, candidates, n)   each candidate's KL from one gradient pass (optimizer.measure.fisher):
                                     what precision passes use where measuring every probe costs too much
    runner.logits(graph, lists)      full-sequence logits through the runtime (optimizer.measure.gate.engine_from_graph)
    runner.generate(graph, prompts, n)   greedy continuations through the runtime
    runner.draft_distillation(graph, module, init, extra)   a draft head's self-distillation objective on all
                                     the calibration text plus `extra` token lists (optimizer.measure.draft_training)

`device` ("cuda"): everything above runs there (observation's block forwards and its Gram products, K/V
capture, sensitivity probes, Fisher sweeps, distillation, `logits`/`generate`) except the draft head's
distillation; the graph's tensors stay on the CPU, and each part is moved as it is built.

The source is the graph as it stands when the runner is made (before any pass): passes replace tensors, never
change them in place, so holding it by reference costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kiln.calibration import progress
from kiln.calibration.data import FORWARD_BATCH_TOKENS
from kiln.optimizer.measure.calibration_session import RuntimeCalibrationSession, RuntimeCalibrator
from kiln.optimizer.measure.draft_training import DraftDistillation
from kiln.optimizer.measure.fisher import Candidates, FisherKl
from kiln.optimizer.measure.gate import engine_from_graph
from kiln.optimizer.measure.kv_capture import KvCapture
from kiln.optimizer.measure.logit_kl import LogitKl
from kiln.passes.graph import ModelGraph

GENERATE_SLICE = 64
"""Prompts `ModelRunner.generate` decodes together: a slice at a time, so a long generation reports progress."""


class RuntimeRunner:
    """The one ModelRunner: a RuntimeCalibrator, a KvCapture and a LogitKl over the same calibration text.

    `calibration_tokens` are what observation, K/V capture and sensitivity run on; `distillation_tokens`
    (default: the same) are what end-to-end tuning fits on, which wants more text than an observation (the
    build driver hands it every calibration paragraph; observation keeps to the first
    len(calibration_tokens), whose Hessians and ranges settle within a few hundred paragraphs)."""

    def __init__(self, source: ModelGraph, calibration_tokens: Sequence[Sequence[int]], *,
                 distillation_tokens: Sequence[Sequence[int]] | None = None,
                 max_batch_tokens: int = FORWARD_BATCH_TOKENS, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.calibration_tokens = [list(t) for t in calibration_tokens]
        if distillation_tokens is None:
            self._calibrator = RuntimeCalibrator(self.calibration_tokens, max_batch_tokens, device=self.device)
        else:
            self._calibrator = RuntimeCalibrator(distillation_tokens, max_batch_tokens,
                                                 observe_sequences=len(self.calibration_tokens), device=self.device)
        self._kv = KvCapture(self.calibration_tokens, max_batch_tokens, device=self.device)
        self._kl = LogitKl(source, self.calibration_tokens, device=self.device)
        self._fisher = FisherKl(self.calibration_tokens, device=self.device)

    @property
    def all_token_lists(self) -> list[list[int]]:
        return self._calibrator.token_lists

    def session(self, graph: ModelGraph) -> RuntimeCalibrationSession:
        return self._calibrator.session(graph)

    def capture_kv(self, graph: ModelGraph) -> dict[int, tuple[torch.Tensor, ...]]:
        return self._kv(graph)

    def logit_kl(self, graph: ModelGraph, paragraphs: int) -> float:
        return self._kl(graph, paragraphs)

    def estimated_kl(self, graph: ModelGraph, candidates: Candidates, paragraphs: int) -> dict:
        return self._fisher(graph, candidates, paragraphs)

    @torch.inference_mode()
    def logits(self, graph: ModelGraph, token_lists: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        return [t.float().cpu() for t in engine_from_graph(graph, device=self.device).logits(token_lists)]

    @torch.inference_mode()
    def generate(self, graph: ModelGraph, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 temperature: float = 0.0, seed: int | None = None,
                 stop_ids: Sequence[int] = ()) -> list[list[int]]:
        engine = engine_from_graph(graph, device=self.device)
        out: list[list[int]] = []
        # in slices, so a long generation reports progress; a slice still batches GENERATE_SLICE prompts together
        with progress.stage("generate", total=len(prompts), unit="prompts") as task:
            for start in range(0, len(prompts), GENERATE_SLICE):
                part = prompts[start:start + GENERATE_SLICE]
                out += [tokens for tokens, _ in engine.generate_ids(
                    part, max_new_tokens, temperature=temperature,
                    seed=None if seed is None else seed + start, stop_ids=stop_ids)]
                task.advance(len(part))
        return out

    def resumed_head(self, path: str, graph: ModelGraph, module, init):
        """The draft head of artifact `path` in place of `init`, and a note (`draft_resume.resumed_head`)."""
        from kiln.optimizer.measure.draft_resume import resumed_head

        return resumed_head(path, graph, module, init)

    def draft_distillation(self, graph: ModelGraph, module, init, extra_token_lists, max_batch_tokens: int = 2048,
                           unroll: int = 2):
        text = [*self.all_token_lists, *extra_token_lists]  # every calibration paragraph, then the extra
        return DraftDistillation(graph, module, init, text, max_batch_tokens, unroll=unroll)
