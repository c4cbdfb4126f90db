"""$ per GPU-hour: the defaults, `--price-per-hour` (one price, pairs per GPU, or a tier table) and the
capacity tiers the waterfall's "capacity" step picks from.

    parse_prices("h100=3.1,b200=6", ["h100", "b200"])     # {"h100": (3.1, "given"), "b200": (6.0, "given")}
    load_tiers("examples/prices/tiers.yaml", ["h100"])     # {"h100": (Tier("on-demand", ...), Tier("spot", ...))}
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from kiln.kernels.errors import KilnError, clip
from kiln.optimizer.report.roofline import GPUS

DEFAULT_PRICES: dict[str, float] = {"h100": 3.40, "h200": 3.80, "b200": 5.50}
PRICE_NOTE = ("Prices are neocloud on-demand $ per GPU-hour. Defaults: H100 $3.40, the middle of the seeds' "
              "$2.89-3.90/h; H200 $3.80 and B200 $5.50 are this report's own assumptions (the seeds quote H100 only). "
              "--price-per-hour overrides them.")


def parse_gpus(text: str) -> list[str]:
    keys = [k.strip().lower() for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in GPUS]
    if not keys or unknown:
        raise KilnError(f"unknown GPU {unknown[0] if unknown else text!r}; choose from {', '.join(GPUS)} "
                        "(comma-separated)")
    return list(dict.fromkeys(keys))


def _positive_price(text: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise KilnError(f"{where} must be a positive number of dollars per GPU-hour, got {text!r}")
    return value


# --- capacity tiers -------------------------------------------------------------------------------------------------
BASELINE_TIER = "on-demand"
TIER_FIELDS = ("price", "interruptions_per_hour", "restart_minutes")
MAX_TIERS = 64


@dataclass(frozen=True)
class Tier:
    """One way to rent a GPU-hour: its billed $/h; for spot capacity, the interruptions an hour and the minutes
    of capacity each costs (rescheduling, reloading the weights, refilling the caches)."""

    name: str
    price: float
    interruptions_per_hour: float = 0.0
    restart_minutes: float = 0.0

    @property
    def available(self) -> float:
        """The fraction of a billed hour that serves: 1 - interruptions/h x restart hours."""
        return 1.0 - self.interruptions_per_hour * self.restart_minutes / 60.0

    @property
    def effective_price(self) -> float:
        """$ per serving GPU-hour: the billed price over the fraction that serves."""
        return self.price / self.available


def is_tier_table(text: str | None) -> bool:
    return text is not None and text.strip().lower().endswith((".yaml", ".yml", ".json"))


def load_tiers(path: str | Path, gpus: Sequence[str]) -> dict[str, tuple[Tier, ...]]:
    """A tier table (YAML or JSON): GPU -> tier name -> a price, or {price, interruptions_per_hour,
    restart_minutes}. Every GPU priced needs an "on-demand" tier (neocloud on-demand: the baseline)."""
    path = Path(path)
    if not path.is_file():
        raise KilnError(f"--price-per-hour: tier table {clip(path)} is not a file")
    try:
        data = yaml.safe_load(path.read_text()[:1 << 20])
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise KilnError(f"--price-per-hour: cannot read tier table {clip(path)}: {type(exc).__name__}") from None
    if not isinstance(data, dict):
        raise KilnError(f"--price-per-hour: tier table {clip(path)} must map GPUs ({', '.join(GPUS)}) to tiers")
    unknown = [k for k in data if str(k).lower() not in GPUS]
    if unknown:
        raise KilnError(f"--price-per-hour: tier table names unknown GPU {str(unknown[0])[:40]!r}; choose from "
                        f"{', '.join(GPUS)}")
    table = {str(k).lower(): v for k, v in data.items()}
    out = {}
    for gpu in gpus:
        entries = table.get(gpu)
        if not isinstance(entries, dict) or BASELINE_TIER not in entries:
            raise KilnError(f"--price-per-hour: tier table has no {BASELINE_TIER!r} tier for {gpu} (the baseline)")
        if len(entries) > MAX_TIERS:
            raise KilnError(f"--price-per-hour: {gpu} has {len(entries)} tiers; at most {MAX_TIERS}")
        out[gpu] = tuple(_tier(gpu, str(name)[:60], entry) for name, entry in entries.items())
    return out


def _tier(gpu: str, name: str, entry) -> Tier:
    where = f"--price-per-hour: {gpu} {name}"
    fields = entry if isinstance(entry, dict) else {"price": entry}
    unknown = [k for k in fields if k not in TIER_FIELDS]
    if unknown:
        raise KilnError(f"{where}: unknown field {str(unknown[0])[:40]!r}; known: {', '.join(TIER_FIELDS)}")
    price = _positive_price(str(fields.get("price")), where)
    extra = {}
    for key in TIER_FIELDS[1:]:
        value = fields.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value >= 0):
            raise KilnError(f"{where}: {key} must be a non-negative number, got {str(value)[:40]!r}")
        extra[key] = float(value)
    tier = Tier(name, price, **extra)
    if not tier.available > 0:
        raise KilnError(f"{where}: {extra['interruptions_per_hour']:g} interruptions an hour of "
                        f"{extra['restart_minutes']:g} minutes each leave no serving time")
    return tier


def parse_prices(text: str | None, gpus: Sequence[str]) -> dict[str, tuple[float, str]]:
    """$/h per GPU and where it came from: "3.1" for every GPU, "h100=3.1,b200=6" (others keep defaults), or a
    tier table's on-demand tier (`load_tiers`)."""
    prices = {k: (DEFAULT_PRICES[k], "default") for k in gpus}
    if text is None:
        return prices
    if is_tier_table(text):
        return {k: (next(t.price for t in tiers if t.name == BASELINE_TIER), "given")
                for k, tiers in load_tiers(text, gpus).items()}
    if "=" not in text:
        value = _positive_price(text.strip(), "--price-per-hour")
        return {k: (value, "given") for k in gpus}
    for pair in text.split(","):
        key, _, value = pair.partition("=")
        key = key.strip().lower()
        if key not in GPUS:
            raise KilnError(f"--price-per-hour: unknown GPU {key!r}; choose from {', '.join(GPUS)}")
        if key in prices:
            prices[key] = (_positive_price(value.strip(), f"--price-per-hour {key}"), "given")
    return prices


def tier_rows(tiers: Sequence[Tier], served: dict, on_demand: float) -> list[dict]:
    """Each tier's $/Mtok for the served model at its largest batch: the on-demand cost x effective price /
    on-demand price (the tokens/s a GPU-hour yields do not depend on how it is rented)."""
    rows = []
    for t in tiers:
        cost = None if served["usd_per_mtok"] is None else served["usd_per_mtok"] * t.effective_price / on_demand
        rows.append({"tier": t.name, "price_per_hour": t.price, "interruptions_per_hour": t.interruptions_per_hour,
                     "restart_minutes": t.restart_minutes, "available": t.available,
                     "effective_price_per_hour": t.effective_price, "usd_per_mtok": cost,
                     "factor_vs_on_demand": on_demand / t.effective_price})
    return rows


def capacity_step(tiers: list[dict], served: dict) -> dict:
    """The waterfall's last step: the cheapest tier per serving hour against neocloud on-demand."""
    row = {"step": "capacity", "label": "capacity tier", "against": "neocloud on-demand", "batch": served["batch"],
           "tokens_per_s": served["tokens_per_s"]}
    best = min(tiers, key=lambda t: t["effective_price_per_hour"]) if tiers else None
    if best is None or best["tier"] == BASELINE_TIER or served["usd_per_mtok"] is None:
        return {**row, "applied": False, "factor": 1.0, "usd_per_mtok": served["usd_per_mtok"],
                "note": ("not applied: one price per GPU (--price-per-hour takes a tier table)" if best is None
                         else "not applied: on-demand is the cheapest tier given")}
    spot = (f", {best['interruptions_per_hour']:g} interruptions/h x {best['restart_minutes']:g} min lost "
            f"({best['available']:.1%} serving)" if best["interruptions_per_hour"] else "")
    return {**row, "label": f"capacity tier ({best['tier']})", "applied": True, "usd_per_mtok": best["usd_per_mtok"],
            "factor": best["factor_vs_on_demand"],
            "note": f"{best['tier']} at ${best['price_per_hour']:.2f}/h{spot}: ${best['effective_price_per_hour']:.2f} "
                    f"per serving hour against on-demand's; the other tiers in the capacity table"}
