"""A serving workload (`optimize report --workload`): arrivals, prompt and output lengths, TTFT and TPOT SLOs;
and the KV link between prefill and decode pools (`--link-gbps`).

    parse_workload("chat")                                      # Workload("chat", 100.0, 2048, 256, 1.0, 0.05)
    parse_workload("rate=10,prompt=1000,output=200,ttft=1,tpot=0.05", rate=5)
    link_bytes_per_second(400)                                  # 50e9
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from kiln.kernels.errors import KilnError

DEFAULT_LINK_GBPS = 400.0  # gigabits/s per GPU: one NDR InfiniBand NIC = 50 GB/s
MAX_PROMPT = 1 << 20
MAX_RATE = 1e6
MAX_SLO = 3600.0

WORKLOAD_KEYS = {"rate": "rate", "prompt": "prompt_tokens", "output": "output_tokens", "ttft": "ttft_slo",
                 "tpot": "tpot_slo"}


def duration(value: float) -> str:
    """A duration as the report prints it: "1.5 s", "50 ms"."""
    return f"{value:.3g} s" if value >= 1 else f"{value * 1e3:.3g} ms"


# --- the workload -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """What a deployment serves: Poisson arrivals at `rate` requests/s in all, each a `prompt_tokens` prompt and
    `output_tokens` output tokens (the first from the prefill), within `ttft_slo` and `tpot_slo` seconds."""

    name: str
    rate: float
    prompt_tokens: int
    output_tokens: int
    ttft_slo: float
    tpot_slo: float

    def __post_init__(self):
        def check(key: str, value, integer: bool, low: float, high: float, what: str) -> None:
            kind = int if integer else int | float
            if isinstance(value, bool) or not isinstance(value, kind) or not (math.isfinite(value)
                                                                             and low <= value <= high):
                raise KilnError(f"--workload {key} must be {what}, got {str(value)[:40]}")

        check("rate", self.rate, False, 1e-12, MAX_RATE, f"a positive number of requests/s up to {MAX_RATE:.0f}")
        check("prompt", self.prompt_tokens, True, 1, MAX_PROMPT, f"a whole number of tokens from 1 to {MAX_PROMPT}")
        check("output", self.output_tokens, True, 2, MAX_PROMPT,
              f"a whole number of tokens from 2 (TPOT needs two) to {MAX_PROMPT}")
        for key, value in (("ttft", self.ttft_slo), ("tpot", self.tpot_slo)):
            check(key, value, False, 1e-9, MAX_SLO, f"a positive number of seconds up to {MAX_SLO:.0f}")

    def describe(self) -> str:
        return (f"{self.name}: {self.rate:g} req/s, {self.prompt_tokens} tokens in, {self.output_tokens} out, "
                f"TTFT <= {duration(self.ttft_slo)}, TPOT <= {duration(self.tpot_slo)}")


PRESETS: dict[str, Workload] = {
    # a chat turn: a 2K-token conversation so far, a 256-token answer
    "chat": Workload("chat", 100.0, 2048, 256, 1.0, 0.05),
    # a document question: a 16K-token document, a 128-token answer; 2 s is about ten times an H100's bare
    # prefill of it (~0.2 s), room for queueing without losing interactivity
    "long-prompt": Workload("long-prompt", 20.0, 16384, 128, 2.0, 0.05),
}


def parse_workload(text: str, rate: float | None = None) -> Workload:
    """A preset name (`chat`, `long-prompt`) or `rate=R,prompt=P,output=O,ttft=S,tpot=S` (seconds; rate in
    requests/s); `rate` (--rate) replaces the workload's."""
    text = text.strip()
    if text.lower() in PRESETS:
        workload = PRESETS[text.lower()]
        fields = asdict(workload)
    elif "=" in text:
        fields = {"name": "custom"}
        for pair in text.split(","):
            key, sep, value = pair.partition("=")
            key = key.strip().lower()
            if not sep or key not in WORKLOAD_KEYS:
                raise KilnError(f"--workload: {pair.strip()[:40]!r} is not one of "
                                f"{', '.join(k + '=' for k in WORKLOAD_KEYS)}")
            if WORKLOAD_KEYS[key] in fields:
                raise KilnError(f"--workload: {key} given twice")
            try:
                number = float(value)
            except ValueError:
                raise KilnError(f"--workload {key} must be a number, got {value.strip()[:40]!r}") from None
            if key in ("prompt", "output"):
                if not (math.isfinite(number) and number == int(number)):
                    raise KilnError(f"--workload {key} must be a whole number of tokens, got {value.strip()[:40]!r}")
                number = int(number)
            fields[WORKLOAD_KEYS[key]] = number
        missing = [k for k, f in WORKLOAD_KEYS.items() if f not in fields and not (k == "rate" and rate is not None)]
        if missing:
            raise KilnError(f"--workload: missing {', '.join(missing)} (give rate=,prompt=,output=,ttft=,tpot=)")
    else:
        raise KilnError(f"--workload: unknown preset {text[:40]!r}; choose {', '.join(PRESETS)} or give "
                        "rate=,prompt=,output=,ttft=,tpot=")
    if rate is not None:
        fields["rate"] = rate
    return Workload(**fields)


def link_bytes_per_second(gbps: float) -> float:
    """--link-gbps (gigabits per second per GPU) in bytes per second."""
    if isinstance(gbps, bool) or not isinstance(gbps, int | float) or not (math.isfinite(gbps) and 0 < gbps <= 1e6):
        raise KilnError(f"--link-gbps must be a positive number of gigabits per second (at most 1e6), got {gbps}")
    return gbps * 1e9 / 8
