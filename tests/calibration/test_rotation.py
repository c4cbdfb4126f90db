"""Block Hadamard rotation: orthogonal for every width (the tail splits into powers of two), its own inverse,
equal to multiplying by its matrix."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.rotation import block_hadamard, block_sizes, hadamard_matrix, rotation_matrix


@pytest.mark.parametrize("k, block", [(64, 16), (64, 32), (172, 32), (172, 16), (12, 32), (96, 64)])
def test_rotation_is_orthogonal_symmetric_and_matches_its_matrix(k, block):
    r = rotation_matrix(k, block)
    assert sum(block_sizes(k, block)) == k
    torch.testing.assert_close(r @ r.T, torch.eye(k), atol=1e-6, rtol=0)
    torch.testing.assert_close(r, r.T)
    x = torch.randn(5, 3, k)
    torch.testing.assert_close(block_hadamard(x, block), x @ r, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(block_hadamard(block_hadamard(x, block), block), x, atol=1e-6, rtol=1e-5)


def test_a_rotated_pair_computes_the_same_product():
    x, w = torch.randn(40, 172), torch.randn(64, 172)
    torch.testing.assert_close(block_hadamard(x, 32) @ block_hadamard(w, 32).T, x @ w.T, atol=1e-4, rtol=1e-5)


def test_hadamard_spreads_an_outlier_over_its_block():
    x = torch.zeros(32)
    x[5] = 8.0
    y = block_hadamard(x, 32)
    assert torch.allclose(y.abs(), torch.full((32,), 8.0 / 32**0.5))


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(12)
    with pytest.raises(ValueError, match="power of two"):
        block_sizes(64, 24)
