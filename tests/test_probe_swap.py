"""Sensitivity probes (optimizer.measure.logit_kl.LogitKl) swap only what a probe changed, and compute exactly what
the runtime computes: every probe is checked against the full lowering it replaces (engine_from_graph: the
whole graph lowered, round-tripped and loaded, the source's log-probs kept at full vocabulary)."""

from __future__ import annotations

import pytest
import torch

from kiln.calibration.data import length_batches
from kiln.calibration.metrics import kl_terms
from kiln.calibration.quantize import calibrated_weight
from kiln.kernels.formats import KvFormat, WeightFormat
from kiln.optimizer.loader import load_checkpoint
from kiln.optimizer.measure.gate import engine_from_graph
from kiln.optimizer.measure.logit_kl import HEAD, LogitKl
from kiln.passes.graph import QuantizedWeight
from kiln.passes.precision_options import OPTIONS
from tests.conftest import STORIES, needs_stories


def full_lowering_kl(source, graph, token_lists) -> float:
    """The reference: both models lowered whole into runtime Engines, KL over full-vocabulary log-probs."""
    def log_probs(engine):
        out = {}
        for batch in length_batches(token_lists, 8192):
            for i, logits in zip(batch, engine.logits([token_lists[i] for i in batch]), strict=True):
                out[i] = torch.log_softmax(logits[:-1].float(), dim=-1)
        return out

    base, cand = log_probs(engine_from_graph(source)), log_probs(engine_from_graph(graph))
    kl = sum(float(kl_terms(base[i], cand[i]).sum()) for i in base)
    return kl / sum(len(t) - 1 for t in token_lists)


def quantize(graph, names, option: str) -> dict:
    """Set round-to-nearest `option` on `names`; returns what they held, to restore."""
    opt = OPTIONS[option]
    before = {}
    for name in names:
        lin = graph.linears[name]
        before[name] = lin.quant
        tensors, method = calibrated_weight(graph.weight(lin).float(), opt.weight, "rtn", None, None)
        lin.quant = QuantizedWeight(opt.weight_format, tensors, opt.runtime_activation, method=method,
                                    in_features=None if opt.weight_format == WeightFormat.FP8_E4M3
                                    else lin.in_features)
    return before


def restore(graph, before: dict) -> None:
    for name, quant in before.items():
        graph.linears[name].quant = quant


def kv_entry(graph, layer: int, scaling: str) -> dict:
    """An FP8 KV annotation for `layer` (static scales and offsets unless dynamic), as the kv-cache pass writes."""
    streams = graph.blocks[layer].attention.kv_streams()
    g = torch.Generator().manual_seed(layer)
    scales = {} if scaling == "dynamic" else {
        name: (torch.tensor(0.004) if scaling == "per_tensor" else torch.full((heads,), 0.004))
        for name, heads, _ in streams}
    offsets = {} if scaling == "dynamic" else {name: 0.1 * torch.randn(heads, dim, generator=g)
                                               for name, heads, dim in streams}
    return {"format": KvFormat.FP8_E4M3, "scaling": scaling, "streams": [n for n, _, _ in streams],
            "scales": scales, "offsets": offsets}


def linears_of(graph, layer, roles):
    return [lin.name for lin in graph.iter_linears() if lin.layer == layer and lin.role in roles]


def check_probes(graph, token_lists, paragraphs: int, max_prefix_bytes=None) -> LogitKl:
    """A precision pass's and the kv-cache pass's probes in turn, each against the full lowering."""
    source = graph.copy_of(graph.snapshot())
    probe = LogitKl(graph, token_lists, max_prefix_bytes=max_prefix_bytes)
    lists = probe.token_lists[:paragraphs]
    last = len(graph.blocks) - 1
    attention = ("q", "k", "v", "q_a", "q_b", "kv_a", "kv_b")

    def same():
        ours, ref = probe(graph, paragraphs), full_lowering_kl(source, graph, lists)
        # abs: the fp32 floor of a mean of KL terms (random tiny models' KL is 1e-7..1e-5, stories260K's 1e-4..0.2)
        assert ours == pytest.approx(ref, rel=1e-6, abs=1e-10)
        return ours

    assert same() == 0.0
    before = quantize(graph, linears_of(graph, 0, ("gate", "up")), "fp8")
    assert same() > 0
    restore(graph, before)
    before = quantize(graph, linears_of(graph, last, attention), "nvfp4")
    assert same() > 0
    restore(graph, before)
    for scaling in ("per_head", "dynamic"):  # the kv-cache pass's probe: one layer's cache quantized
        graph.kv_cache = {last: kv_entry(graph, last, scaling)}
        assert same() > 0
    graph.kv_cache = {}
    before = quantize(graph, ["lm_head"], "fp8")
    assert same() > 0
    restore(graph, before)
    assert same() == 0.0
    before = quantize(graph, linears_of(graph, 1, ("down", "expert")), "nvfp4")
    assert same() > 0
    restore(graph, before)
    return probe


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.tiny_models import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("probe")
    return {"llama": make_tiny_checkpoint("llama", root / "llama"),
            "llama-tied": make_tiny_checkpoint("llama", root / "tied", overrides={"tie_word_embeddings": True}),
            "deepseek_v3": make_tiny_checkpoint("deepseek_v3", root / "deepseek_v3")}


def random_tokens(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(8, 40, (), generator=g)),), generator=g).tolist()
            for _ in range(count)]


@pytest.mark.parametrize("model", ["llama", "llama-tied", "deepseek_v3"])
def test_probes_equal_the_full_lowering_on_tiny_models(tiny, model):
    graph = load_checkpoint(tiny[model])
    check_probes(graph, random_tokens(6, graph.spec.vocab_size), paragraphs=5)


@needs_stories
def test_probes_equal_the_full_lowering_on_stories260k(stories_graph):
    from kiln.calibration.data import read_paragraphs, tokenize_paragraphs
    from kiln.optimizer.defaults import CALIBRATION_TEXT
    from kiln.runtime.engine import load_tokenizer

    tokens = tokenize_paragraphs(load_tokenizer(STORIES), read_paragraphs(CALIBRATION_TEXT, 12))
    probe = check_probes(stories_graph, tokens, paragraphs=12)
    # more paragraphs than the reference holds: the source is swapped back in for the missing ones
    lists = probe.token_lists[:12]
    source = stories_graph.copy_of(stories_graph.snapshot())
    quantize(stories_graph, linears_of(stories_graph, 2, ("o",)), "nvfp4")
    assert probe(stories_graph, 6) == pytest.approx(full_lowering_kl(source, stories_graph, lists[:6]), rel=1e-6)


def test_a_probe_rebuilds_and_runs_only_what_it_changed(tiny):
    graph = load_checkpoint(tiny["deepseek_v3"])  # 3 layers: MLA, a dense MLP, then MoE
    probe = LogitKl(graph, random_tokens(4, graph.spec.vocab_size), max_prefix_bytes=None)
    probe(graph, 4)
    assert set(probe.builds) == {"embedding", 0, 1, 2, HEAD} and set(probe.builds.values()) == {1}
    layers = len(graph.blocks)

    def cost(change):
        builds, runs = probe.builds.copy(), probe.blocks_run
        probe(graph, 4)
        change()
        return dict(probe.builds - builds), probe.blocks_run - runs

    for layer in range(layers):
        names = linears_of(graph, layer, ("gate", "up", "expert"))
        before = quantize(graph, names, "fp8")
        assert cost(lambda: None) == ({layer: 1}, layers - layer)  # one block rebuilt, blocks layer.. run
        restore(graph, before)
        assert cost(lambda: None) == ({layer: 1}, layers - layer)
    graph.kv_cache = {1: kv_entry(graph, 1, "per_tensor")}
    assert cost(lambda: None) == ({}, layers - 1)  # a KV format builds nothing: blocks 1.. run with it
    snapshot = graph.snapshot()
    graph.restore(snapshot)  # deep-copies the KV annotations: equal values are no change
    assert cost(lambda: None) == ({}, 0)
    before = quantize(graph, ["lm_head"], "fp8")
    assert cost(lambda: None) == ({HEAD: 1}, 0)  # the head alone, on the kept last hidden states
    restore(graph, before)


def test_without_room_for_block_inputs_every_probe_runs_the_whole_model(tiny):
    graph = load_checkpoint(tiny["llama"])
    probe = check_probes(graph, random_tokens(5, graph.spec.vocab_size), paragraphs=5, max_prefix_bytes=0)
    assert probe.blocks_run == 2 * 9  # the source, then eight calls: each the whole model (2 blocks, 1 batch)


def test_a_bounded_prefix_keeps_every_other_block_input_and_the_same_values(tiny):
    graph = load_checkpoint(tiny["deepseek_v3"])
    lists = random_tokens(4, graph.spec.vocab_size)
    one_input = sum(len(b) * max(len(lists[i]) for i in b) for b in length_batches(lists, 8192)) * 64 * 4
    bounded = LogitKl(graph, lists, max_prefix_bytes=2 * one_input)  # the last block's output and block 2's input
    unbounded = LogitKl(graph, lists, max_prefix_bytes=None)
    for kl in (bounded, unbounded):
        kl(graph, 4)
    for layer, runs in ((2, 1), (1, 3), (0, 3)):  # block 1 starts from the embedding, block 2 from its input
        before = quantize(graph, linears_of(graph, layer, ("o",)), "nvfp4")
        start = bounded.blocks_run
        assert bounded(graph, 4) == pytest.approx(unbounded(graph, 4), rel=1e-6, abs=1e-10)
        assert bounded.blocks_run - start == runs
        restore(graph, before)


def test_a_refused_part_leaves_no_stale_state(tiny):
    from kiln.kernels.errors import KilnError

    graph = load_checkpoint(tiny["llama"])
    source = graph.copy_of(graph.snapshot())
    lists = random_tokens(4, graph.spec.vocab_size)
    probe = LogitKl(graph, lists, max_prefix_bytes=None)
    probe(graph, 4)
    norm = graph.spec.layers[1].norms[0]
    good = graph.tensors[norm]
    quantize(graph, linears_of(graph, 0, ("gate", "up")), "nvfp4")  # block 0 swaps, then block 1 is refused
    graph.tensors[norm] = torch.full_like(good, float("nan"))
    with pytest.raises(KilnError, match="non-finite"):
        probe(graph, 4)
    graph.tensors[norm] = good
    assert probe(graph, 4) == pytest.approx(full_lowering_kl(source, graph, probe.token_lists[:4]), rel=1e-6,
                                            abs=1e-10)
