"""benchmarks/vllm_check.py's reading of greedy partings: a near-tie, a choice decided by FP8 activation rounding
(W8A8), or a real disagreement."""

from __future__ import annotations

from tests.conftest import benchmark


def vllm_check():
    return benchmark("vllm_check")


def _kiln(pair_gaps):
    return {"paragraphs": [[1, 2, 3]], "nll": [1.0], "prompts": [[1], [1], [1]],
            "greedy": [[5, 6], [5, 7], [5, 8]], "top2_gap": lambda prefix: 0.4, "pair_gaps": pair_gaps}


def test_partings_are_classified_by_what_the_activation_rounding_moves():
    margins = {6: (0.2, -0.1), 7: (0.4, 0.3), 8: (0.4, None)}  # Kiln's token -> (shipped, unrounded) margins
    vllm = {"nll": [1.0], "greedy": [{"tokens": [5, 9], "top2": [[0, -1], [0, -1]]}] * 3}
    result = vllm_check().compare(_kiln(lambda prefix, ours, theirs: margins[ours]), vllm, near_tie=0.1)
    first, second, third = result["partings"]
    assert first["rounding"] and abs(first["activation_shift"] - 0.3) < 1e-9  # unrounded, vLLM's token wins
    assert not second["rounding"]  # rounding moved it 0.1 of 0.4: a real preference
    assert "rounding" not in third and not third["near_tie"]  # W8A16: nothing to attribute to activations
    assert result["identical"] == 0 and result["prompts"] == 3
