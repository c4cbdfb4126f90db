"""The serving model (`optimize report --workload`): one iteration and the steady states against figures computed
here by hand, sizing that moves the right way with the workload, the verdict in the regimes where each deployment
is known to win, the KV transfer, and the command with its presets and bad input."""

from __future__ import annotations

import json
import math

import pytest

from kiln.kernels.targets import B200, H100
from kiln.optimizer.loader_config import build_spec
from kiln.optimizer.report.economics import economics_report
from kiln.optimizer.report.roofline import decode_step, prefill_seconds
from kiln.optimizer.report.scenarios import config_scenario
from kiln.optimizer.report.serving_model import (
    BUDGETS,
    MeasuredCost,
    RequestClass,
    RooflineCost,
    colocated_state,
    size_disaggregated,
)
from kiln.optimizer.report.serving_section import serving_section
from kiln.optimizer.report.workload import PRESETS, Workload, link_bytes_per_second, parse_workload
from tests.optimizer.test_economics import LLAMA_8B

LINK = 50e9  # bytes/s: the default 400 Gb/s


@pytest.fixture(scope="module")
def llama_fp8():
    return config_scenario("8b", build_spec(LLAMA_8B), weights="fp8").served.figures


# --- one iteration ---------------------------------------------------------------------------------------------------
def test_a_decode_only_iteration_by_hand_is_economics_decode_step(llama_fp8):
    cost = RooflineCost(llama_fp8, H100)
    # weights read: all of Llama-3.1-8B FP8's 9,086,705,664 bytes but the 128256 x 4096 BF16 embedding
    weights = 9_086_705_664 - 2 * 128256 * 4096
    kv = 64 * 4096 * 131_072  # 64 rows of 4096 tokens, 131,072 BF16 KV bytes a token
    by_hand = (weights + kv) / 3.35e12
    assert cost.seconds(64, 4096) == pytest.approx(by_hand, rel=1e-12)
    assert cost.seconds(64, 4096) == pytest.approx(decode_step(llama_fp8, H100, 64, 4096).seconds, rel=1e-12)


def test_a_prefill_chunk_by_hand_and_the_chunks_add_up_to_economics_prefill(llama_fp8):
    cost = RooflineCost(llama_fp8, H100)
    # GEMMs: the 6,979,321,856 FP8 linear params at 1979 TFLOPs, the BF16 LM head (128256 x 4096) at 989
    per_token = 2 * 6_979_321_856 / 1979e12 + 2 * 128256 * 4096 / 989e12
    c = 32 * 32 * (128 + 128)  # layers x heads x (qk + v dims)
    attention = c * (16384 * 16385 - 8192 * 8193) / 989e12  # tokens 8193..16384 against all before them
    assert cost.seconds(0, 0, 8192, 8192) == pytest.approx(8192 * per_token + attention, rel=1e-12)
    whole = cost.seconds(0, 0, 8192, 0) + cost.seconds(0, 0, 8192, 8192)
    assert whole == pytest.approx(prefill_seconds(llama_fp8, H100, 16384), rel=1e-12)


def test_decode_rows_add_their_kv_reads_to_a_chunk_iteration(llama_fp8):
    cost = RooflineCost(llama_fp8, H100)
    alone = cost.seconds(0, 0, 2048, 0)
    # the GEMMs stay compute-bound (2048 + 10 tokens); the rows' attention reads their KV, a kernel of its own
    with_rows = cost.seconds(10, 4096, 2048, 0)
    rows_kv = 10 * 4096 * 131_072 / 3.35e12
    gemm_rows = 10 * (2 * 6_979_321_856 / 1979e12 + 2 * 128256 * 4096 / 989e12)
    assert with_rows == pytest.approx(alone + rows_kv + gemm_rows, rel=1e-9)


# --- steady states by hand -------------------------------------------------------------------------------------------
def test_the_colocated_steady_state_by_hand():
    # a device of measured rates: a decode forward 10 ms + 1 ms a row, a prompt chunk 0.1 ms a token
    cost = MeasuredCost(decode_fixed=0.010, decode_per_row=0.001, prefill_fixed=0.0, prefill_per_token=1e-4)
    classes = [RequestClass(1.0, 100, 11)]  # 100-token prompts (one chunk), 10 decode steps each
    s = colocated_state(cost, 2.0, classes, budget=512, max_sequences=64)
    # TPOT t: D = 2 x 10 x t; a chunk iteration 0.021 + 0.001 D, a decode-only one 0.011 + 0.001 D;
    # 1/t = 2 + (1 - 2 (0.021 + 0.001 D)) / (0.011 + 0.001 D)  =>  0.011 + 0.02 t = 0.98 t  =>  t = 0.011 / 0.96
    t = 0.011 / 0.96
    assert s.saturated is None and s.tpot == pytest.approx(t, rel=1e-9)
    d = 20 * t
    assert s.decode_rows == pytest.approx(d, rel=1e-9)
    service = 0.010 * d + 0.001 * d + 100 * 1e-4  # the prompt's one chunk, the D rows riding along
    rho = 2 * service
    wait = 2 * service**2 / (2 * (1 - rho))  # Pollaczek-Khinchine, deterministic service
    residual = (1 - rho) * (1 - math.exp(-d)) * (0.010 + 0.001 * (1 + d)) / 2
    assert s.prefill_share == pytest.approx(rho, rel=1e-9)
    assert s.ttft[0] == pytest.approx(wait + residual + service, rel=1e-9)
    assert s.slowest == pytest.approx(0.021 + 0.001 * d, rel=1e-9)  # the chunk iteration a decoding row waits for


def test_the_pools_counts_by_hand():
    cost = MeasuredCost(decode_fixed=0.010, decode_per_row=0.001, prefill_fixed=0.0, prefill_per_token=1e-4)
    w = Workload("hand", 20.0, 2000, 11, ttft_slo=1.0, tpot_slo=0.0125)
    dis = size_disaggregated(cost, w, max_sequences=1000, kv_bytes=2.5e9, link=LINK, prefill_fits=True)
    # prefill: S = 0.2 s, T = 0.05 s; M/D/1: 0.2 rho / (2 (1 - rho)) + 0.25 <= 1  =>  rho <= 15/17  =>  4.41 req/s a
    # GPU  =>  ceil(20 / 4.41) = 5
    assert dis.prefill_gpus == 5 and dis.prefill.transfer == pytest.approx(0.05)
    assert dis.prefill_capacity == pytest.approx(15 / 17 / 0.2, rel=1e-3)
    # decode: t = 0.011 + 0.001 x 10 lambda t  =>  t = 0.011 / (1 - 0.01 lambda) <= 0.0125  =>  lambda <= 12
    assert dis.decode_gpus == 2 and dis.decode_capacity == pytest.approx(12, rel=1e-3)
    assert dis.decode.tpot == pytest.approx(0.011 / (1 - 0.01 * 10), rel=1e-9)
    # a 5 GB/s link: T = 0.5 s > S, the link is the prefill GPU's bottleneck: 0.5 rho / (2 (1 - rho)) + 0.7 <= 1
    # =>  rho <= 6/11  =>  12/11 req/s a GPU  =>  19 prefill GPUs; a decode GPU's link takes under 2 prompts/s  =>  11
    slow = size_disaggregated(cost, w, max_sequences=1000, kv_bytes=2.5e9, link=5e9, prefill_fits=True)
    assert (slow.prefill_gpus, slow.decode_gpus) == (19, 11)
    assert slow.prefill.ttft == pytest.approx(0.5 * (20 / 19 * 0.5) / (2 * (1 - 20 / 19 * 0.5)) + 0.7, rel=1e-9)


# --- the KV transfer ---------------------------------------------------------------------------------------------------
def test_kv_transfer_is_bytes_over_the_link(llama_fp8):
    assert link_bytes_per_second(400) == 50e9
    section = serving_section(llama_fp8, H100, 3.4, PRESETS["long-prompt"], link_bytes_per_second(100))
    d = section["disaggregated"]
    assert d["kv_bytes_per_prompt"] == 16384 * 131_072
    assert d["kv_transfer_s"] == 16384 * 131_072 / 12.5e9
    # the transfer is in TTFT: a slower link never lowers it, at the same prefill GPUs
    fast = serving_section(llama_fp8, H100, 3.4, PRESETS["long-prompt"], link_bytes_per_second(1600))
    assert fast["disaggregated"]["kv_transfer_s"] == d["kv_transfer_s"] / 16
    if fast["disaggregated"]["prefill_gpus"] == d["prefill_gpus"]:
        assert fast["disaggregated"]["ttft_s"] < d["ttft_s"]


# --- sizing moves the right way ----------------------------------------------------------------------------------------
def _section(figures, device, text: str) -> dict:
    return serving_section(figures, device, 3.4, parse_workload(text))


def test_more_rate_never_needs_fewer_gpus(llama_fp8):
    for device in (H100, B200):
        before = None
        for rate in (5, 10, 20, 40, 80, 160):
            s = _section(llama_fp8, device, f"rate={rate},prompt=4096,output=256,ttft=1,tpot=0.04")
            counts = (s["colocated"]["gpus"], s["disaggregated"]["prefill_gpus"], s["disaggregated"]["decode_gpus"])
            if before:
                assert all(a >= b for a, b in zip(counts, before, strict=True)), (rate, counts, before)
            before = counts
        assert before[0] > 4  # the last rate needs several GPUs


def test_a_tighter_ttft_never_needs_fewer_prefill_gpus(llama_fp8):
    counts = [_section(llama_fp8, H100, f"rate=40,prompt=8192,output=128,ttft={t},tpot=0.05")["disaggregated"]
              ["prefill_gpus"] for t in (4, 2, 1, 0.5, 0.3)]
    assert counts == sorted(counts) and counts[-1] > counts[0]


# --- the verdict in known regimes ----------------------------------------------------------------------------------------
def test_long_prompts_and_a_tight_tpot_favour_disaggregation(llama_fp8):
    s = _section(llama_fp8, H100, "rate=100,prompt=16384,output=128,ttft=10,tpot=0.01")
    co, dis = s["colocated"], s["disaggregated"]
    assert s["winner"] == "disaggregated" and dis["gpus"] < co["gpus"]
    assert s["factor"] == pytest.approx(co["gpus"] / dis["gpus"])
    assert co["budget"] < BUDGETS[0] and "chunks shrink" in s["verdict"]  # a big chunk misses the TPOT SLO
    assert s["factor"] == pytest.approx(co["usd_per_mtok"] / dis["usd_per_mtok"])


def test_a_tight_ttft_a_loose_tpot_and_short_prompts_favour_colocation(llama_fp8):
    s = _section(llama_fp8, H100, "rate=200,prompt=2048,output=256,ttft=0.05,tpot=0.2")
    assert s["winner"] == "co-located" and s["colocated"]["gpus"] < s["disaggregated"]["gpus"]
    assert s["factor"] == 1.0 and s["colocated"]["budget"] == BUDGETS[0]


def test_an_unreachable_slo_is_said_not_sized(llama_fp8):
    s = _section(llama_fp8, H100, "rate=1,prompt=16384,output=128,ttft=0.05,tpot=0.05")  # a 16K prefill takes 0.2 s
    assert s["colocated"]["gpus"] is None and s["disaggregated"]["gpus"] is None and s["winner"] is None
    assert "no GPU count meets TTFT" in s["verdict"]


def test_the_waterfall_step_takes_the_better_deployment(llama_fp8):
    scn = config_scenario("8b", build_spec(LLAMA_8B), weights="fp8")
    for text, applied in (("rate=100,prompt=16384,output=128,ttft=10,tpot=0.01", True), ("chat", False)):
        report = economics_report(scn, ["h100"], workload=parse_workload(text))
        g = report["gpus"]["h100"]
        step, before = g["waterfall"][-1], g["waterfall"][-2]
        assert step["step"] == "disaggregation" and step["applied"] is applied
        assert step["factor"] == pytest.approx(g["serving"]["factor"]) and step["factor"] >= 1.0
        assert step["usd_per_mtok"] == pytest.approx(before["usd_per_mtok"] / step["factor"])
        assert g["total_factor"] == pytest.approx(g["waterfall"][0]["usd_per_mtok"] / step["usd_per_mtok"])
    assert "disaggregation" not in [r["step"] for r in economics_report(scn, ["h100"])["gpus"]["h100"]["waterfall"]]


# --- the command -------------------------------------------------------------------------------------------------------
def test_report_serving_section_for_both_presets(cli, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    for preset in ("chat", "long-prompt"):
        code, stdout, stderr = cli("report", tmp_path / "config.json", "--weights", "fp8", "--gpu", "h100,b200",
                                   "--workload", preset, "--json")
        assert code == 0, stderr
        report = json.loads(stdout)
        w = PRESETS[preset]
        assert report["serving"]["workload"]["prompt_tokens"] == w.prompt_tokens
        assert report["serving"]["link_gbps"] == 400
        for key in ("h100", "b200"):
            s = report["gpus"][key]["serving"]
            assert s["winner"] in ("co-located", "disaggregated") and s["verdict"]
            for d in (s["colocated"], s["disaggregated"]):
                assert d["ttft_s"] <= w.ttft_slo and d["tpot_s"] <= w.tpot_slo
                assert d["goodput_per_gpu"] == pytest.approx(w.rate / d["gpus"])
                assert d["usd_per_mtok"] == pytest.approx(277.78 * report["gpus"][key]["price_per_hour"]
                                                          / (w.rate * w.output_tokens / d["gpus"]), rel=1e-4)
            assert s["colocated"]["slowest_iteration_s"] <= w.tpot_slo
    code, stdout, stderr = cli("report", tmp_path, "--weights", "fp8", "--gpu", "h100", "--workload", "long-prompt",
                               "--rate", "5", "--link-gbps", "200", "-o", tmp_path / "out")
    assert code == 0, stderr
    assert "co-located" in stdout and "disaggregated" in stdout and "Serving model assumptions" in stdout
    text = (tmp_path / "out" / "report.md").read_text()
    assert "### Serving: long-prompt: 5 req/s" in text and "200 Gb/s" in text and "| disaggregation |" in text


@pytest.mark.parametrize("args, message", [
    (("--workload", "nope"), "unknown preset 'nope'"),
    (("--workload", "rate=-1,prompt=2048,output=256,ttft=1,tpot=0.05"), "rate must be a positive number"),
    (("--workload", "chat", "--rate", "0"), "rate must be a positive number"),
    (("--workload", "rate=1,prompt"), "'prompt' is not one of"),
    (("--workload", "rate=1,prompt=2048,output=256,ttft=1"), "missing tpot"),
    (("--workload", "rate=1,prompt=2k,output=256,ttft=1,tpot=1"), "prompt must be a number"),
    (("--workload", "rate=1,prompt=100,output=1,ttft=1,tpot=1"), "TPOT needs two"),
    (("--workload", "chat", "--link-gbps", "0"), "--link-gbps must be a positive number"),
    (("--rate", "3"), "--rate sets a --workload"),
    (("--link-gbps", "100"), "--link-gbps prices the KV transfer of a --workload"),
])
def test_bad_serving_input_is_one_line_exit_2(cli, tmp_path, args, message):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    code, _, stderr = cli("report", tmp_path / "config.json", "--gpu", "h100", *args)
    assert code == 2 and stderr.startswith("error: ") and message in stderr, stderr
    assert stderr.count("\n") == 1
