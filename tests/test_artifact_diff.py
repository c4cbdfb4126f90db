"""benchmarks/artifact_diff.py: stored tensors compared element by element, FP4 codes two to a byte."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from tests.conftest import benchmark

diff = benchmark("artifact_diff")


def test_fp4_codes_count_per_nibble_and_fp8_bytes_as_stored(tmp_path):
    codes = torch.tensor([[0x21, 0x43], [0x65, 0x87]], dtype=torch.uint8)
    fp8 = torch.tensor([0.0, 1.0], dtype=torch.float8_e4m3fn)
    base = {"l.weight": codes, "l.weight_scale": torch.ones(2), "f.weight": fp8, "norm": torch.ones(3)}
    save_file(base, tmp_path / "a.safetensors")
    save_file(base, tmp_path / "same.safetensors")
    changed = dict(base, **{"l.weight": codes ^ torch.tensor([[0x10, 0], [0, 0x11]], dtype=torch.uint8),
                            "f.weight": torch.tensor([-0.0, 1.0], dtype=torch.float8_e4m3fn)})
    save_file(changed, tmp_path / "b.safetensors")
    assert all(row[1] == row[3] == 0 for row in diff.compare(tmp_path / "a.safetensors",
                                                             tmp_path / "same.safetensors").values())
    rows = diff.compare(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert rows["FP4 codes (two a byte)"] == [1, 1, 8, 3]  # one nibble in byte 0, both in byte 3
    assert rows["FP8 values"] == [1, 1, 2, 1]  # -0 is stored as another byte
    assert rows["scales"] == [1, 0, 2, 0] and rows["other"] == [1, 0, 3, 0]
    save_file({"other": torch.ones(1)}, tmp_path / "c.safetensors")
    assert "different tensors" in diff.compare(tmp_path / "a.safetensors", tmp_path / "c.safetensors")
