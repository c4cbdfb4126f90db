"""`optimize build --device`: calibration's probes, Fisher sweeps, K/V capture and distillation run on the
runner's device. This machine has no GPU, so the meta device stands in (as in tests/runtime/
test_device_runtime.py): an op that mixes a CPU tensor with a meta one raises "not on the expected device",
as it would with a CUDA one, while meta tensors run every op that does not need their values. Each check runs
the work on meta until the first op that needs values (reading a number back, or a boolean mask's nonzero)
and requires that to be where it stops."""

from __future__ import annotations

import pytest
import torch

from kiln.optimizer.loader import load_checkpoint
from kiln.optimizer.measure.calibration_session import RuntimeCalibrator
from kiln.optimizer.measure.fisher import FisherKl
from kiln.optimizer.measure.kv_capture import KvCapture
from kiln.optimizer.measure.logit_kl import LogitKl
from kiln.passes.end_to_end_tuning import tune_end_to_end
from tests.test_probe_swap import linears_of, quantize, random_tokens, restore

META = torch.device("meta")
READ_BACK = r"item\(\) cannot be called on meta tensors"  # the number read back at the very end
MASKED = "nonzero"  # a boolean mask's shape depends on values: meta cannot go past it


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tests.tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("device") / "llama",
                                overrides={"tie_word_embeddings": True})


def test_a_probe_runs_every_block_on_the_device_and_reads_back_only_the_kl(llama):
    graph = load_checkpoint(llama)
    tokens = random_tokens(6, graph.spec.vocab_size)
    layers = len(graph.spec.layers)
    probe = LogitKl(graph, tokens, device=META)
    before = quantize(graph, linears_of(graph, 1, ("gate", "up", "down")), "nvfp4")
    try:
        with pytest.raises(RuntimeError, match=READ_BACK):
            probe(graph, 6)
    finally:
        restore(graph, before)
    batches = len(probe._probe.batches)
    # the source's reference (every block), then the candidate from block 1 (its kept input), all on meta
    assert probe.blocks_run == batches * (layers + layers - 1)
    parts = probe._model.parts
    assert all(t.device == META for key, part in parts.items() if isinstance(key, int)
               for t in (*part.module.parameters(), *part.module.buffers()))
    assert parts["embedding"].module.device == META
    assert all(h.device == META for kept in probe._probe.hidden.values() for h in kept)
    assert all(r.device == META for r in probe._reference)
    assert graph.tensors[graph.embedding].device.type == "cpu"  # the graph itself stays on the CPU


def test_cpu_probe_is_unchanged_by_the_device_argument(llama):
    graph = load_checkpoint(llama)
    tokens = random_tokens(6, graph.spec.vocab_size)
    given, default = LogitKl(graph, tokens, device="cpu"), LogitKl(graph, tokens)  # the source: as it is now
    before = quantize(graph, linears_of(graph, 0, ("q", "k", "v")), "fp8")
    try:
        assert given(graph, 6) == default(graph, 6) > 0
    finally:
        restore(graph, before)


def test_fisher_sweeps_run_the_model_on_the_device(llama):
    graph = load_checkpoint(llama)
    tokens = random_tokens(4, graph.spec.vocab_size)
    names = linears_of(graph, 0, ("gate", "up"))
    before = quantize(graph, names, "fp8")
    state = {n: graph.linears[n].quant for n in names}
    restore(graph, before)
    with pytest.raises(NotImplementedError, match=MASKED):  # the whole forward ran; the scored positions' mask
        FisherKl(tokens, device=META)(graph, {"mlp0": state}, 4)


def test_kv_capture_runs_the_model_on_the_device(llama):
    graph = load_checkpoint(llama)
    with pytest.raises(NotImplementedError, match=MASKED):  # through the first attention, to the cache's mask
        KvCapture(random_tokens(4, graph.spec.vocab_size), device=META)(graph)


def test_distillation_tunes_parameters_on_the_device(llama):
    graph = load_checkpoint(llama)
    tokens = random_tokens(4, graph.spec.vocab_size)
    names = linears_of(graph, 0, ("q", "k", "v", "o", "gate", "up", "down"))
    quantize(graph, names, "nvfp4")
    session = RuntimeCalibrator(tokens, device=META).session(graph)
    assert session.device == META
    seen = {}

    def distillation(latents, norms, batch_tokens, extra):
        seen["latents"], seen["norms"] = latents, norms
        seen["objective"] = objective = type(session).distillation(session, latents, norms, batch_tokens, extra)
        return objective

    session.distillation = distillation
    with pytest.raises(NotImplementedError, match=MASKED):  # the teacher's forward ran; its real tokens' mask
        tune_end_to_end(graph, session, names, steps=1, lr=1e-3, batch_tokens=256, log=lambda _: None,
                        embedding=True)
    assert all(fq.latent.device == META for fq in seen["latents"].values())
    assert graph.embedding in seen["norms"] and all(p.device == META for p in seen["norms"].values())
    objective = seen["objective"]
    for model in (objective.teacher, objective.student):
        assert all(t.device == META for t in (*model.parameters(), *model.buffers()))
    # the student computes with the tuned parameters themselves (not copies place() made of them)
    assert objective.student.embed is seen["norms"][graph.embedding]
    assert graph.linears[names[0]].quant.tensors["weight"].device.type == "cpu"  # nothing stored: it stopped
