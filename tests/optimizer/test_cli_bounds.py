"""Every numeric option of every command is typed and bounded, and checked while the command line is parsed
(issue #18, 3): one line naming the value and the allowed range, exit 2, before any file is read. The paths
given here do not exist, so an option that slipped through would fail on the missing file instead, with
another message."""

from __future__ import annotations

import json
import time

import pytest

from tests.conftest import STORIES, needs_stories

HUGE = str(2**70)  # `--seed 2^70` crashed generate with a traceback
GATE = ("gate", "no-art", "--baseline", "no-ckpt", "--data", "no-text", "--min-recovery", "0.9")


@pytest.mark.parametrize("args, expected", [
    (("generate", "no-art", "hi", "--seed", HUGE), f"--seed must be an integer in [0, 4294967295], got {HUGE}"),
    (("generate", "no-art", "hi", "--seed", "-1"), "--seed must be an integer in [0, 4294967295], got -1"),
    (("generate", "no-art", "hi", "--temperature", "nan"), "--temperature must be a finite number >= 0"),
    (("generate", "no-art", "hi", "--temperature", "inf"), "--temperature must be a finite number >= 0"),
    (("generate", "no-art", "hi", "--top-p", "0"), "--top-p must be a finite number in (0, 1], got 0"),
    (("generate", "no-art", "hi", "--repetition-penalty", "-inf"), "--repetition-penalty must be a finite number > 0"),
    (("generate", "no-art", "hi", "--max-new-tokens", "1000000000"), "--max-new-tokens must be an integer in [0, 1048576]"),
    (("generate", "no-art", "hi", "--draft-tokens", "0"), "--draft-tokens must be an integer in [1, 16], got 0"),
    (("generate", "no-art", "hi", "--tree-width", "9"), "--tree-width must be an integer in [1, 8] (1: a chain)"),
    ((*GATE, "--resamples", str(10**9)), "--resamples must be an integer in [1, 100000]"),
    ((*GATE, "--resamples", str(10**11)), "--resamples must be an integer in [1, 100000]"),
    ((*GATE, "--seed", HUGE), "--seed must be an integer in [0, 4294967295]"),
    ((*GATE, "--generate", "100000000"), "--generate must be an integer in [0, 10000]"),
    ((*GATE, "--generate-tokens", "0"), "--generate-tokens must be an integer in [1, 65536]"),
    ((*GATE, "--paragraphs", "0"), "--paragraphs must be an integer in [1, 1000000] (each is scored), got 0"),
    ((*GATE, "--task-limit", "0"), "--task-limit must be an integer >= 1, got 0"),
    (("eval", "no-art", "--data", "no-text", "--paragraphs", str(10**12)), "--paragraphs must be an integer in [1,"),
    (("eval", "no-art", "--data", "no-text", "--draft-tokens", "99"), "--draft-tokens must be an integer in [1, 16]"),
    (("build", "no-ckpt", "--weight-bits", "inf"), "--weight-bits must be a finite number in (0, 16], got inf"),
    (("build", "no-ckpt", "--kv-fraction", "nan"), "--kv-fraction must be a finite number in (0, 1], got nan"),
    (("build", "no-ckpt", "--kv-bytes-per-token", "0"), "--kv-bytes-per-token must be an integer >= 1, got 0"),
    (("build", "no-ckpt", "--calib-tokens", "-5"), "--calib-tokens must be an integer >= 1, got -5"),
    (("build", "no-ckpt", "--weight-bytes", "0"), "--weight-bytes must be an integer >= 1, got 0"),
    (("serve", "no-art", "--port", "70000"), "--port must be an integer in [0, 65535], got 70000"),
    (("serve", "no-art", "--max-num-seqs", "1000000"), "--max-num-seqs must be an integer in [1, 4096]"),
    (("serve", "no-art", "--max-num-batched-tokens", "0"), "--max-num-batched-tokens must be an integer in [1,"),
    (("serve", "no-art", "--max-queue", str(10**9)), "--max-queue must be an integer in [1, 1048576]"),
    (("serve", "no-art", "--request-timeout", "inf"), "--request-timeout must be a finite number > 0, got inf"),
    (("report", "no-art", "--tau", "nan"), "--tau must be a finite number >= 1, got nan"),
    (("report", "no-art", "--gpus-per-replica", "0"), "--gpus-per-replica must be an integer in [1, 1024]"),
    (("report", "no-art", "--draft-tokens", "0"), "--draft-tokens must be an integer in [1, 16], got 0"),
])
def test_out_of_range_options_are_one_line_before_any_work(cli, args, expected):
    start = time.perf_counter()
    code, stdout, stderr = cli(*args)
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]
    assert time.perf_counter() - start < 5 and not stdout


def test_integral_options_refuse_fractions(cli):
    code, _, stderr = cli("generate", "no-art", "hi", "--tree-width", "2.5")
    assert code == 2 and "Invalid value for '--tree-width'" in stderr and stderr.count("\n") == 1, stderr


def test_report_refuses_a_config_declaring_a_billion_layers(cli, tmp_path):
    """It built one spec per declared layer, growing without bound; now the size is refused before any spec."""
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 4, "num_hidden_layers": 10**9, "vocab_size": 512}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    start = time.perf_counter()
    code, _, stderr = cli("report", path)
    assert code == 2 and "num_hidden_layers = 1000000000 is above 1024" in stderr and stderr.count("\n") == 1, stderr
    assert time.perf_counter() - start < 5
    for field, value, message in (("num_local_experts", 10**6, "num_local_experts = 1000000 is above 1024"),
                                  ("head_dim", 10**8, "head_dim = 100000000 is above 4096"),
                                  ("num_attention_heads", "four", "num_attention_heads must be a positive integer")):
        path.write_text(json.dumps({**config, "num_hidden_layers": 2, field: value,
                                    **({"model_type": "mixtral"} if field == "num_local_experts" else {})}))
        code, _, stderr = cli("report", path)
        assert code == 2 and message in stderr and stderr.count("\n") == 1, stderr


@needs_stories
def test_in_range_options_still_work(cli, tmp_path):
    code, stdout, stderr = cli("report", STORIES / "config.json", "--json", "--gpus-per-replica", "2")
    assert code == 0, stderr
    assert json.loads(stdout)["gpus_per_replica"] == 2


@needs_stories
def test_a_conflicting_recipe_is_refused_before_the_checkpoint_is_read(cli, tmp_path):
    for recipe, message in (("fp8-kv,nvfp4-kv", "two 'kv-cache' passes both set the KV cache's format"),
                            ("fp8-weights,nvfp4-w4a16", "two 'weight-quant' passes both quantize the same linears")):
        start = time.perf_counter()
        code, _, stderr = cli("build", STORIES, "--recipe", recipe, "-o", tmp_path / "out")
        lines = stderr.strip().splitlines()  # the build's first log line (threads) may come before it
        assert code == 2 and lines[-1].startswith("error: ") and message in lines[-1], stderr
        assert sum(line.startswith("error:") for line in lines) == 1 and "load checkpoint" not in stderr
        assert time.perf_counter() - start < 5 and not (tmp_path / "out").exists()


def test_the_bootstrap_refuses_an_unbounded_resample_count_from_python_too():
    from kiln.optimizer.measure.gate import MAX_RESAMPLES, recovery_interval
    from tests.conftest import refused

    refused(recovery_interval, [1.0], [1.0], [3], 10**11, match=f"--resamples must be an integer in [1, {MAX_RESAMPLES}]")
    low, high = recovery_interval([1.0, 2.0], [1.1, 2.0], [3, 4], MAX_RESAMPLES)
    assert 0 < low <= high <= 1.0
