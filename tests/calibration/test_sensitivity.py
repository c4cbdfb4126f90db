"""The budgeted assignment is exact (checked against brute force), refuses impossible budgets in one line,
and the sensitivity table survives its JSON and config forms."""

from __future__ import annotations

import itertools
import random

import pytest

from kiln.calibration.sensitivity import (
    Choice,
    SensitivityTable,
    cheapest_bytes,
    rank_correlation,
    solve_assignment,
)
from kiln.kernels.errors import KilnError


def brute_force(choices, budget):
    groups = list(choices)
    best = None
    for combo in itertools.product(*(list(choices[g].items()) for g in groups)):
        cost = sum(c.cost_bytes for _, c in combo)
        loss = sum(c.loss for _, c in combo)
        if cost <= budget and (best is None or (loss, cost) < best[:2]):
            best = (loss, cost, {g: o for g, (o, _) in zip(groups, combo, strict=True)})
    return best


def random_choices(rng: random.Random, groups: int) -> dict[str, dict[str, Choice]]:
    out = {}
    for g in range(groups):
        size = 64 * rng.choice([64, 96, 172, 256])
        # the shapes of the real options: narrower formats cost fewer bytes and lose more
        out[f"layers.{g}.group"] = {  # 4.25, 4.5, 8.25 and 16 bits per weight
            "mxfp4": Choice(size * 17 // 32, rng.uniform(2e-3, 3e-2)),
            "nvfp4": Choice(size * 18 // 32, rng.uniform(1e-3, 2e-2)),
            "fp8-w8a8": Choice(size * 33 // 32, rng.uniform(1e-5, 1e-3)),
            "bf16": Choice(size * 2, 0.0),
        }
    return out


@pytest.mark.parametrize("seed", range(12))
def test_solver_matches_brute_force(seed):
    rng = random.Random(seed)
    choices = random_choices(rng, groups=rng.randint(1, 6))
    low = cheapest_bytes(choices)
    high = sum(max(c.cost_bytes for c in opts.values()) for opts in choices.values())
    budget = rng.randint(low, high)
    solved = solve_assignment(choices, budget)
    loss, cost, _ = brute_force(choices, budget)
    assert solved.exact
    assert solved.total_bytes <= budget
    assert solved.total_loss == pytest.approx(loss, rel=1e-12, abs=1e-15)
    assert solved.total_bytes == sum(choices[g][o].cost_bytes for g, o in solved.options.items())
    assert solved.total_loss == pytest.approx(sum(choices[g][o].loss for g, o in solved.options.items()))
    assert cost == solved.total_bytes or loss == pytest.approx(solved.total_loss)


def test_budget_at_the_extremes():
    choices = random_choices(random.Random(1), groups=5)
    cheapest = solve_assignment(choices, cheapest_bytes(choices))
    assert set(cheapest.options.values()) == {"mxfp4"}
    everything = solve_assignment(choices, 10**9)
    assert set(everything.options.values()) == {"bf16"} and everything.total_loss == 0


def test_impossible_budget_is_a_one_line_error():
    choices = random_choices(random.Random(2), groups=3)
    with pytest.raises(KilnError) as err:
        solve_assignment(choices, cheapest_bytes(choices) - 1)
    message = str(err.value)
    assert "\n" not in message and "smallest reachable size" in message


def test_bucketed_frontier_still_fits_the_budget():
    choices = random_choices(random.Random(3), groups=8)
    budget = (cheapest_bytes(choices) * 3) // 2
    rough = solve_assignment(choices, budget, max_states=4)
    exact = solve_assignment(choices, budget)
    assert not rough.exact and exact.exact
    assert rough.total_bytes <= budget
    assert rough.total_loss >= exact.total_loss - 1e-15


def test_bad_choices_are_refused():
    with pytest.raises(KilnError, match="no candidate option"):
        solve_assignment({"g": {}}, 100)
    with pytest.raises(KilnError, match="finite loss"):
        solve_assignment({"g": {"a": Choice(1, float("nan"))}}, 100)


def test_table_round_trips_through_json_and_config_entries():
    table = SensitivityTable({"layers.0.qkv": {"nvfp4": 1e-3, "fp8-w8a8": 2e-5, "bf16": 0.0},
                              "layers.0.o": {"nvfp4": 4e-4, "fp8-w8a8": 1e-5, "bf16": 0.0}}, tokens=123, offset=1e-6)
    again = SensitivityTable.from_json(table.to_json())
    assert again.losses == table.losses and again.tokens == 123 and again.offset == pytest.approx(1e-6)
    from_entries = SensitivityTable.from_entries(table.entries())
    assert from_entries.losses == table.losses
    assert table.options() == ["nvfp4", "fp8-w8a8", "bf16"]
    with pytest.raises(KilnError, match="no entry"):
        table.loss("layers.0.qkv", "mxfp4")
    with pytest.raises(KilnError, match="malformed"):
        SensitivityTable.from_json({"losses": 3})
    with pytest.raises(KilnError, match="group, option, loss"):
        SensitivityTable.from_entries([("a", "b")])


def test_rank_correlation():
    a = {"x": 1.0, "y": 2.0, "z": 3.0}
    assert rank_correlation(a, {"x": 10.0, "y": 20.0, "z": 30.0}) == pytest.approx(1.0)
    assert rank_correlation(a, {"x": 3.0, "y": 2.0, "z": 1.0}) == pytest.approx(-1.0)
    with pytest.raises(KilnError):
        rank_correlation(a, {"x": 1.0})
