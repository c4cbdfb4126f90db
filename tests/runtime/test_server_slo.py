"""`optimize serve --ttft-slo/--tpot-slo`: /metrics counts finished requests against the SLOs (kiln_slo_*), what
a Prometheus SLO rule divides for attainment and goodput."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kiln.kernels.errors import KilnError
from kiln.runtime.server_metrics import ServerMetrics, scrape
from kiln.runtime.serving_state import ServerConfig


def _finished(ttft, tpot, reason="length"):
    return SimpleNamespace(prompt_ids=[1, 2], finish_reason=reason, ttft=ttft, tpot=tpot, finished_at=None,
                           arrival=0.0)


def test_slo_counters_count_each_objective_and_both():
    metrics = ServerMetrics(ttft_slo=0.5, tpot_slo=0.05)
    for ttft, tpot in ((0.2, 0.01), (0.7, 0.01), (0.2, 0.09), (0.9, 0.2), (0.3, None)):  # None: one token
        metrics.observe_finished(_finished(ttft, tpot))
    metrics.observe_finished(_finished(None, None))  # aborted before its first token: not held to the SLOs
    metrics.observe_finished(_finished(0.1, 0.01, reason="abort"))  # not finished: not counted anywhere
    m = scrape(metrics.exposition().decode())
    assert (m["kiln_slo_requests_total"], m["kiln_slo_ttft_met_total"], m["kiln_slo_tpot_met_total"],
            m["kiln_slo_met_total"]) == (5, 3, 3, 2)


def test_without_slos_there_are_no_slo_series_and_one_slo_alone_counts():
    assert not any(k.startswith("kiln_slo_") for k in scrape(ServerMetrics().exposition().decode()))
    metrics = ServerMetrics(ttft_slo=0.5)
    metrics.observe_finished(_finished(0.2, 9.0))
    m = scrape(metrics.exposition().decode())
    assert (m["kiln_slo_requests_total"], m["kiln_slo_tpot_met_total"], m["kiln_slo_met_total"]) == (1, 1, 1)


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan")])
def test_bad_slos_are_refused(value):
    with pytest.raises(KilnError, match="--ttft-slo must be a positive number of seconds"):
        ServerConfig(ttft_slo=value)


def test_cli_refuses_a_bad_slo_in_one_line(cli, tmp_path):
    code, _, stderr = cli("serve", tmp_path, "--tpot-slo", "0")
    assert code == 2 and "--ttft-slo/--tpot-slo must be a finite number > 0" in stderr and stderr.count("\n") == 1
