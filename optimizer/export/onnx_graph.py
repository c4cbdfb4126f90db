"""The pieces the ONNX export builds its graph from: the artifact's tensors read one at a time, the initializers
(inline, or appended to an external data file as they are made), and a node builder whose every op returns the
name of its output.

    with open_tensors(path) as tensors, Initializers(data_path) as inits:
        g = GraphBuilder(inits)
        w = g.initializer("w", float32(tensors["w"]))
        y = g.op("Gemm", [x, w], "name", transB=1)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Self

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import set_external_data
from safetensors import safe_open

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
EXTERNAL_MIN_BYTES = 1024  # smaller initializers (shapes, scalars) stay inline either way


# --- reading the artifact's tensors one at a time -------------------------------------------------------------

class ArtifactTensors(Mapping):
    """The artifact's tensors by name, read from the safetensors file when asked (one at a time)."""

    def __init__(self, handle):
        self.handle = handle
        self.names = set(handle.keys())

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise KeyError(name)
        return self.handle.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.names))

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self.names


@contextlib.contextmanager
def open_tensors(path: Path) -> Iterator[ArtifactTensors]:
    with safe_open(str(path), framework="pt") as handle:
        yield ArtifactTensors(handle)


def exported_bytes(tensors: ArtifactTensors) -> int:
    """About what the initializers take: floats widen to fp32; bytes (codes, E8M0 scales) at most double."""
    total = 0
    for name in tensors:
        piece = tensors.handle.get_slice(name)
        numel = int(np.prod(piece.get_shape(), dtype=np.int64))
        total += numel * {"F32": 4, "BF16": 4, "F16": 4, "F8_E4M3": 1, "U8": 2}.get(piece.get_dtype(), 8)
    return total


class Initializers:
    """The graph's initializers. With a data file, every one of EXTERNAL_MIN_BYTES or more is appended to it as
    it is made, so memory holds one weight at a time however large the model."""

    def __init__(self, data_path: Path | None):
        self.data_path = data_path
        self.file = None
        self.tensors: list[TensorProto] = []

    def __enter__(self) -> Self:
        if self.data_path is not None:
            self.file = open(self.data_path, "wb")
        return self

    def __exit__(self, *exc) -> None:
        if self.file is not None:
            self.file.close()

    def add(self, tensor: TensorProto) -> str:
        if self.file is not None and len(tensor.raw_data) >= EXTERNAL_MIN_BYTES:
            offset = -self.file.tell() % 4096 + self.file.tell()  # page-aligned, so a runtime can map it
            self.file.seek(offset)
            self.file.write(tensor.raw_data)
            set_external_data(tensor, DATA_FILE, offset, len(tensor.raw_data))
            tensor.ClearField("raw_data")
        self.tensors.append(tensor)
        return tensor.name


# --- the graph ----------------------------------------------------------------------------------------------

class GraphBuilder:
    """Nodes and initializers being built; every op returns its output's name."""

    def __init__(self, inits: Initializers):
        self.inits = inits
        self.nodes: list[onnx.NodeProto] = []
        self.constants: dict[tuple, str] = {}
        self.count = 0

    def op(self, op_type: str, inputs: list[str], name: str, **attrs) -> str:
        return self.ops(op_type, inputs, name, 1, **attrs)[0]

    def ops(self, op_type: str, inputs: list[str], name: str, outputs: int, **attrs) -> list[str]:
        self.count += 1
        outs = [f"{name}/{op_type}_{self.count}" + (f":{k}" if k else "") for k in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=outs[0], **attrs))
        return outs

    def initializer(self, name: str, array: np.ndarray) -> str:
        return self.inits.add(numpy_helper.from_array(np.ascontiguousarray(array), name))

    def raw(self, name: str, dtype: int, dims: tuple[int, ...], data: bytes) -> str:
        return self.inits.add(helper.make_tensor(name, dtype, list(dims), data, raw=True))

    def const(self, value, dtype=np.float32) -> str:
        """A small shared constant (a shape, an axis list, a scalar)."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self.constants:
            self.constants[key] = self.initializer(f"const_{len(self.constants)}", array)
        return self.constants[key]


def float32(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().contiguous().numpy()


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()
