"""Per-group sensitivity to each candidate precision, and the exact assignment under a byte budget.

    table[group][option] = loss of quantizing `group` alone to `option`, everything else as it was
                           (Kiln measures mean per-token KL(baseline || candidate) of the final logits on
                           calibration text, through the runtime; see optimizer.measure.logit_kl)
    cost[group][option]  = bytes the group's weights and scales take in `option`

    solve_assignment(choices, budget):  minimize  sum_g table[g][o_g]  subject to  sum_g cost[g][o_g] <= budget
        frontier = [(0 bytes, 0 loss)]
        for each group g:                               # dynamic programming over groups
            frontier = pareto({(b + cost[g][o], l + table[g][o]) for (b, l) in frontier, o in options(g)})
            drop states that cannot fit the budget even with every later group at its cheapest option
        return the state of least loss (ties: fewer bytes), traced back through the stages

`pareto` keeps, among states sorted by bytes, only those whose loss is strictly below every cheaper state's:
a dominated state can never be part of an optimum, so the result is exact at byte resolution (no
discretization). If a frontier ever grows past `max_states` (very many groups with many distinct costs), the
states are merged into cost buckets and the result says `exact=False`; every result respects the budget.

Losses add across groups: the objective treats the groups' losses as independent (first-order in the
perturbation). The accuracy gate checks the combined model afterwards, and the pass backs off if needed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from kiln.kernels.errors import KilnError

DEFAULT_MAX_STATES = 200_000


@dataclass(frozen=True)
class Choice:
    """One option for one group: what it costs and what it loses."""

    cost_bytes: int
    loss: float


@dataclass(frozen=True)
class Assignment:
    options: dict[str, str]  # group -> chosen option
    total_bytes: int
    total_loss: float
    exact: bool  # False only if the frontier had to be bucketed (see module docstring)
    frontier_states: int  # the largest frontier the solver kept (a measure of the work done)


def cheapest_bytes(choices: Mapping[str, Mapping[str, Choice]]) -> int:
    """The fewest bytes any assignment can take: every group at its cheapest option."""
    return sum(min(c.cost_bytes for c in options.values()) for options in choices.values())


def solve_assignment(choices: Mapping[str, Mapping[str, Choice]], budget_bytes: int,
                     max_states: int = DEFAULT_MAX_STATES) -> Assignment:
    """The per-group options of least total loss whose total cost is at most `budget_bytes`.

    Args:
        choices: group -> option -> Choice (cost in bytes, loss >= 0). Every group needs one option at least.
        budget_bytes: the largest total cost allowed.
        max_states: frontier size above which states are bucketed by cost (then `exact` is False).

    Raises:
        KilnError: no assignment fits the budget (message: the budget and the cheapest reachable total).
    """
    if not choices:
        return Assignment({}, 0, 0.0, True, 1)
    for group, options in choices.items():
        if not options:
            raise KilnError(f"group {group!r} has no candidate option")
        for option, c in options.items():
            if c.cost_bytes < 0 or not math.isfinite(c.loss):
                raise KilnError(f"group {group!r} option {option!r}: cost {c.cost_bytes} and loss {c.loss} must "
                                "be a non-negative size and a finite loss")
    floor = cheapest_bytes(choices)
    if floor > budget_bytes:
        raise KilnError(f"weight budget of {budget_bytes} bytes is below the smallest reachable size, "
                        f"{floor} bytes (every group at its narrowest allowed format)")
    groups = list(choices)
    # cheapest cost of the groups after stage i, for pruning states that can no longer fit
    tail = [0] * (len(groups) + 1)
    for i in range(len(groups) - 1, -1, -1):
        tail[i] = tail[i + 1] + min(c.cost_bytes for c in choices[groups[i]].values())

    # A state is (bytes, loss, parent index in the previous frontier, option index); option -1 for the root.
    frontier: list[tuple[int, float, int, int]] = [(0, 0.0, -1, -1)]
    stages: list[list[tuple[int, float, int, int]]] = []
    exact = True
    largest = 1
    for i, group in enumerate(groups):
        options = list(choices[group].items())
        room = budget_bytes - tail[i + 1]
        candidates = [
            (b + c.cost_bytes, loss + c.loss, parent, k)
            for parent, (b, loss, _, _) in enumerate(frontier)
            for k, (_, c) in enumerate(options)
            if b + c.cost_bytes <= room
        ]
        frontier = _pareto(candidates)
        if len(frontier) > max_states:
            frontier = _bucket(frontier, max_states)
            exact = False
        largest = max(largest, len(frontier))
        stages.append(frontier)

    best = min(range(len(frontier)), key=lambda j: (frontier[j][1], frontier[j][0]))
    total_bytes, total_loss = frontier[best][0], frontier[best][1]
    chosen: dict[str, str] = {}
    index = best
    for i in range(len(groups) - 1, -1, -1):
        _, _, parent, k = stages[i][index]
        chosen[groups[i]] = list(choices[groups[i]])[k]
        index = parent
    return Assignment({g: chosen[g] for g in groups}, total_bytes, total_loss, exact, largest)


def _pareto(states: list[tuple[int, float, int, int]]) -> list[tuple[int, float, int, int]]:
    # sort by bytes, then loss; keep a state only if its loss beats every cheaper (or equal-cost) state's
    states.sort(key=lambda s: (s[0], s[1]))
    kept: list[tuple[int, float, int, int]] = []
    best_loss = math.inf
    for s in states:
        if s[1] < best_loss:
            kept.append(s)
            best_loss = s[1]
    return kept


def _bucket(frontier: list[tuple[int, float, int, int]], max_states: int) -> list[tuple[int, float, int, int]]:
    # keep the least-loss state of each cost bucket; the kept states' true costs are still exact
    low, high = frontier[0][0], frontier[-1][0]
    width = max(1, math.ceil((high - low + 1) / max_states))
    best: dict[int, tuple[int, float, int, int]] = {}
    for s in frontier:
        key = (s[0] - low) // width
        if key not in best or s[1] < best[key][1]:
            best[key] = s
    return _pareto(list(best.values()))


@dataclass
class SensitivityTable:
    """Measured losses: group -> option -> loss, plus how they were measured.

    Attributes:
        losses: group -> option -> loss (the metric named by `metric`, >= 0 after subtracting `offset`).
        metric: what a loss is, e.g. "kl-logits" (mean per-token KL of the final logits, nats).
        tokens: how many calibration tokens the measurement scored.
        offset: the metric of the graph before the pass (already subtracted from every loss).
    """

    losses: dict[str, dict[str, float]] = field(default_factory=dict)
    metric: str = "kl-logits"
    tokens: int = 0
    offset: float = 0.0

    def groups(self) -> list[str]:
        return list(self.losses)

    def options(self) -> list[str]:
        seen: dict[str, None] = {}
        for per_group in self.losses.values():
            for option in per_group:
                seen.setdefault(option)
        return list(seen)

    def loss(self, group: str, option: str) -> float:
        try:
            return self.losses[group][option]
        except KeyError:
            raise KilnError(f"sensitivity table has no entry for group {group!r} in option {option!r}") from None

    def to_json(self) -> dict:
        return {"metric": self.metric, "tokens": self.tokens, "offset": round(self.offset, 10),
                "losses": {g: {o: round(float(v), 10) for o, v in per.items()} for g, per in self.losses.items()}}

    @classmethod
    def from_json(cls, data: Mapping) -> SensitivityTable:
        try:
            losses = {str(g): {str(o): float(v) for o, v in per.items()} for g, per in data["losses"].items()}
            return cls(losses, str(data.get("metric", "kl-logits")), int(data.get("tokens", 0)),
                       float(data.get("offset", 0.0)))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise KilnError(f"malformed sensitivity table: {exc}") from None

    def entries(self) -> tuple[tuple[str, str, float], ...]:
        """(group, option, loss) triples: the form pass configs carry."""
        return tuple((g, o, float(v)) for g, per in self.losses.items() for o, v in per.items())

    @classmethod
    def from_entries(cls, entries, metric: str = "kl-logits", tokens: int = 0, offset: float = 0.0
                     ) -> SensitivityTable:
        losses: dict[str, dict[str, float]] = {}
        for entry in entries:
            if len(entry) != 3:
                raise KilnError(f"a sensitivity entry is (group, option, loss), got {entry!r}")
            group, option, loss = entry
            losses.setdefault(str(group), {})[str(option)] = float(loss)
        return cls(losses, metric, tokens, offset)


def rank_correlation(a: Mapping[str, float], b: Mapping[str, float]) -> float:
    """Spearman's rank correlation of two scores over their common keys (ties get average ranks).

    Used to state how well a cheap proxy (e.g. relative weight error) agrees with the measured KL.
    """
    keys = sorted(set(a) & set(b))
    if len(keys) < 2:
        raise KilnError(f"rank correlation needs two common keys at least, got {len(keys)}")
    ra, rb = _ranks([a[k] for k in keys]), _ranks([b[k] for k in keys])
    mean = (len(keys) - 1) / 2
    cov = sum((x - mean) * (y - mean) for x, y in zip(ra, rb, strict=True))
    var_a = sum((x - mean) ** 2 for x in ra)
    var_b = sum((y - mean) ** 2 for y in rb)
    if var_a == 0 or var_b == 0:
        return 0.0
    return cov / math.sqrt(var_a * var_b)


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks
