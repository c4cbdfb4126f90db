"""Streaming builds: the graph reads the checkpoint lazily, spills what passes replace, the calibrator reads one
block, and model.safetensors is written tensor by tensor, byte for byte as safetensors writes it."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.calibration import data
from kiln.calibration.data import ACTIVATION_BYTES, FORWARD_BATCH_TOKENS, forward_batch_tokens
from kiln.calibration.observers import InputObserver
from kiln.kernels.targets import get_target
from kiln.optimizer.loader import CheckpointTensors, load_checkpoint
from kiln.optimizer.lower import lower_tensors, tensor_bytes, write_artifact, write_safetensors
from kiln.optimizer.measure.calibration_session import RuntimeCalibrator
from kiln.optimizer.measure.runner import RuntimeRunner
from kiln.passes.base import PassContext, Pipeline
from kiln.passes.tensor_store import Spilled, SpilledTensors, SpillFile, TensorStore
from kiln.passes.weight_quant import WeightQuantization

MANIFEST = {"source": {"model_type": "llama"}, "target": "hopper", "recipe": {"name": "t", "passes": []}, "passes": []}


def _tensors() -> dict[str, torch.Tensor]:
    """Every dtype an artifact or checkpoint holds, 0-dim and empty tensors, and names that sort across dtypes."""
    g = torch.Generator().manual_seed(0)
    return {"model.layers.0.mlp.down_proj.weight": torch.randn(5, 3, generator=g).to(torch.float8_e4m3fn),
            "model.layers.0.mlp.down_proj.weight_scale": torch.rand(5, 1, generator=g),
            "model.layers.0.mlp.down_proj.input_scale": torch.tensor(0.25),
            "a.weight": torch.randn(7, 4, generator=g).to(torch.bfloat16), "b": torch.randn(3, generator=g).half(),
            "packed": torch.randint(0, 255, (4, 8), dtype=torch.uint8, generator=g),
            "e5m2": torch.randn(6, generator=g).to(torch.float8_e5m2), "empty": torch.zeros(0, 4),
            "double": torch.randn(2, generator=g).double(), "index": torch.arange(5), "mask": torch.tensor([True, False]),
            "zz.weight": torch.randn(2, 2, generator=g)}


@pytest.mark.parametrize("metadata", [{"format": "pt"}, None, {}])
def test_streamed_safetensors_equal_save_file_byte_for_byte(tmp_path, metadata):
    tensors = _tensors()
    save_file(tensors, tmp_path / "reference.safetensors", metadata=metadata)
    write_safetensors(tmp_path / "streamed.safetensors", tensors, metadata)
    assert (tmp_path / "streamed.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()


class _Recording(Mapping[str, torch.Tensor]):
    """A checkpoint's lazy tensors that remember which were read."""

    def __init__(self, base: CheckpointTensors):
        self.base, self.read = base, set()

    def __getitem__(self, name):
        self.read.add(name)
        return self.base[name]

    def __contains__(self, name) -> bool:
        return name in self.base

    def __iter__(self) -> Iterator[str]:
        return iter(self.base)

    def __len__(self) -> int:
        return len(self.base)

    def info(self, name):
        return self.base.info(name)


def test_the_loaded_graph_holds_no_tensor_and_reads_each_on_access(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    graph = load_checkpoint(path)
    assert isinstance(graph.tensors.base, CheckpointTensors) and not graph.tensors.overlay
    stored = load_file(path / "model.safetensors")
    assert set(graph.tensors) == set(stored)
    assert all(torch.equal(graph.tensors[k], v) and graph.tensors.info(k) == (v.dtype, tuple(v.shape))
               for k, v in stored.items())
    assert len(graph.tensors.base._held) == 0  # nothing is kept once its readers let go
    recording = graph.tensors.base = _Recording(graph.tensors.base)
    tensors, _ = lower_tensors(graph)
    assert tensor_bytes(tensors) == sum(v.numel() * v.element_size() for v in stored.values())
    assert not recording.read  # lowering and sizing read nothing


def test_a_replaced_tensor_spills_and_reads_back_bit_for_bit(tiny_checkpoints):
    graph = load_checkpoint(tiny_checkpoints["llama"])
    graph.tensors.spill.threshold = 0  # the tiny model's tensors are all below the default threshold
    name = "model.layers.0.mlp.up_proj.weight"
    before = graph.snapshot()
    replaced = graph.tensors[name].float() * 3
    graph.tensors[name] = replaced
    entry = graph.tensors.entry(name)
    assert isinstance(entry, Spilled) and graph.tensors.spill.spilled_bytes >= replaced.numel() * 4
    assert graph.tensors[name] is replaced  # the same tensor while someone holds it
    expected = replaced.clone()
    del replaced
    again = graph.tensors[name]
    assert torch.equal(again, expected) and again.dtype == torch.float32  # read back from the spill file
    graph.restore(before)  # restoring drops the overlay entry; the checkpoint's is back
    assert graph.tensors.entry(name) is graph.tensors.base and torch.equal(graph.tensors[name] * 3, expected)


def test_the_calibrator_reads_only_the_blocks_it_runs(tiny_checkpoints):
    graph = load_checkpoint(tiny_checkpoints["llama"])
    recording = graph.tensors.base = _Recording(graph.tensors.base)
    session = RuntimeCalibrator([[1, 5, 9, 14], [3, 4]]).session(graph)
    assert not recording.read  # opening a session (and its distillation teacher) reads nothing
    seen = []
    session.observe(["model.layers.0.self_attn.q_proj"], lambda name, x: seen.append(x.shape))
    assert seen and recording.read and all(n.startswith(("model.embed_tokens.", "model.layers.0.")) for n in recording.read)
    recording.read.clear()
    session.observe(["model.layers.1.mlp.down_proj"], lambda name, x: seen.append(x.shape))
    # block 0 runs forward once more (to reach block 1), block 1 is observed; the head is never built
    assert recording.read and all(n.startswith(("model.layers.0.", "model.layers.1.")) for n in recording.read)


def test_spilling_changes_nothing_in_a_calibrated_build(tiny_checkpoints, tmp_path):
    """fp8-weights' pass (AWQ folds, GPTQ) with every replaced and packed tensor spilled to disk writes the same
    artifact, byte for byte, as with everything kept in memory."""
    tokens = [[int(t) for t in torch.randint(3, 160, (24,), generator=torch.Generator().manual_seed(i))]
              for i in range(6)]
    artifacts = []
    for threshold in (0, 1 << 62):
        graph = load_checkpoint(tiny_checkpoints["llama"])
        graph.tensors.spill.threshold = threshold
        ctx = PassContext(get_target("hopper"), runner=RuntimeRunner(graph, tokens))
        Pipeline([WeightQuantization(format="fp8", method="gptq", awq=True)]).run(graph, ctx)
        quant = graph.linears["model.layers.1.mlp.down_proj"].quant
        assert isinstance(quant.tensors, SpilledTensors) == (threshold == 0)
        assert isinstance(graph.tensors.entry("model.layers.1.mlp.up_proj.weight"), Spilled) == (threshold == 0)
        artifacts.append(write_artifact(graph, tmp_path / str(threshold), MANIFEST, "report"))
    spilled, kept = ((a / "model.safetensors").read_bytes() for a in artifacts)
    assert spilled == kept


def test_a_store_copy_is_a_snapshot(tmp_path):
    store = TensorStore({"a": torch.ones(2), "b": torch.zeros(2)}, spill=SpillFile(threshold=0, directory=tmp_path))
    snapshot = store.copy()
    store["a"] = torch.full((2,), 7.0)
    del store["b"]
    store["c"] = torch.arange(3)
    assert list(store) == ["a", "c"] and torch.equal(store["a"], torch.full((2,), 7.0))
    assert list(snapshot) == ["a", "b"] and torch.equal(snapshot["a"], torch.ones(2))
    assert "b" not in store and store.info("c") == (torch.int64, (3,))


def test_forward_batches_narrow_for_wide_blocks():
    assert forward_batch_tokens(1536) == FORWARD_BATCH_TOKENS  # SmolLM2: as before
    assert forward_batch_tokens(14336) == 585  # an 8B MLP: [585, 14336] fp32 is just under 32 MiB
    assert forward_batch_tokens(14336) * 14336 * 4 <= ACTIVATION_BYTES < (forward_batch_tokens(14336) + 1) * 14336 * 4
    assert forward_batch_tokens(10**9) == 1
    with pytest.raises(ValueError):
        forward_batch_tokens(0)


def test_narrow_forward_batches_observe_the_same_statistics(tiny_checkpoints, monkeypatch):
    """A session's batches hold at most forward_batch_tokens(widest) padded tokens (a longer paragraph alone),
    and the statistics they add up to are those of one batch."""
    tokens = [[int(t) for t in torch.randint(3, 160, (n,), generator=torch.Generator().manual_seed(n))]
              for n in (3, 4, 6, 9, 12, 17)]
    name = "model.layers.1.mlp.down_proj"
    graph = load_checkpoint(tiny_checkpoints["llama"])
    widest = max(max(lin.in_features, lin.out_features) for lin in graph.linears.values() if lin.layer is not None)
    observers = {}
    for cap in (None, 8):
        if cap is not None:
            monkeypatch.setattr(data, "ACTIVATION_BYTES", 4 * widest * cap)
        session = RuntimeCalibrator(tokens, max_batch_tokens=10_000).session(load_checkpoint(tiny_checkpoints["llama"]))
        assert session.batch_tokens == (cap or 10_000)
        assert len(session.batches) == (1 if cap is None else 5)  # 3+4, 6, 9, 12, 17: the longer ones alone
        assert all(b.tokens.numel() <= session.batch_tokens or b.tokens.shape[0] == 1 for b in session.batches)
        observer = observers[cap] = InputObserver(graph.linears[name].in_features)
        session.observe([name], lambda n, x, o=observer: o.update(x))
    wide, narrow = observers[None], observers[8]
    assert wide.tokens == narrow.tokens == sum(map(len, tokens))
    torch.testing.assert_close(narrow.hessian, wide.hessian, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(narrow.abs_mean, wide.abs_mean, rtol=1e-6, atol=1e-8)
    assert torch.equal(narrow.absmax, wide.absmax)
