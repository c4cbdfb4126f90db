"""`optimize serve`: the OpenAI-compatible server, run as a real subprocess on the stories260K fp8-weights artifact.

The official `openai` client works against it unchanged; a greedy completion is `Engine.generate`'s text (and
`optimize generate`'s); a full queue answers 429 with Retry-After; a client that goes away, or a request past
--request-timeout, is aborted and gives its KV blocks back; bad requests are 400s in OpenAI's error shape; SIGTERM
drains the requests in flight (new ones get 503) and exits 0.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from kiln.runtime.server_metrics import scrape
from tests.conftest import EVAL_TEXT, STORIES, untuned

pytestmark = pytest.mark.skipif(not (STORIES / "config.json").is_file(), reason="../shared/models absent")

PROMPT = "Once upon a time"
# 32 choices of 480 tokens: over 2 s of decoding even where the CPU runtime decodes stories260K at 1 ms a token
# (450 tokens of one choice took 0.45 s on a free 2-core machine: shorter than the timeouts below)
LONG = {"max_tokens": 480, "n": 32, "ignore_eos": True, "temperature": 0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`optimize serve ARTIFACT --port P ARGS...` as a subprocess (started by `start`, ready after `wait`)."""

    def __init__(self, artifact: Path, log_dir: Path, *args: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stdout, self.stderr = log_dir / f"serve-{self.port}.out", log_dir / f"serve-{self.port}.err"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        with self.stdout.open("w") as out, self.stderr.open("w") as err:
            # eager unless a test names a --compile mode: a background compile would load the CPU the other
            # tests' timing bounds assume
            compile_mode = () if "--compile" in args else ("--compile", "off")
            self.proc = subprocess.Popen([sys.executable, "-m", "kiln.optimizer.cli", "serve", str(artifact),
                                          "--port", str(self.port), *args, *compile_mode], stdout=out, stderr=err,
                                         env=env)

    def logs(self) -> str:
        return self.stdout.read_text() + self.stderr.read_text()

    def wait(self, timeout: float = 90) -> Server:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited {self.proc.returncode}: {self.logs()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"the server did not come up in {timeout} s: {self.logs()}")

    def post(self, path: str, body: dict, **kw) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=kw.pop("timeout", 60), **kw)

    def metrics(self) -> dict[str, float]:
        return scrape(httpx.get(f"{self.url}/metrics", timeout=10).text)

    def idle_metrics(self, timeout: float = 15) -> dict[str, float]:
        """/metrics once nothing runs, waits or holds a KV block."""
        end = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["kiln_num_requests_running"], m["kiln_num_requests_waiting"], m["kiln_kv_cache_usage_ratio"]) \
                    == (0, 0, 0) or time.monotonic() > end:
                return m
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    from kiln.optimizer.build import build

    # 32 calibration paragraphs, no gate: these tests need an fp8-weights artifact, not a well-calibrated one
    return build(STORIES, "hopper", untuned("fp8-weights"), tmp_path_factory.mktemp("serve") / "stories-fp8",
                 gate=False, calib_paragraphs=32).path


@pytest.fixture(scope="module")
def servers(artifact, tmp_path_factory):
    """The main server (timeout 1 s) and a small one (one sequence, a queue of one); started together."""
    logs = tmp_path_factory.mktemp("serve-logs")
    main = Server(artifact, logs, "--request-timeout", "1")
    small = Server(artifact, logs, "--max-queue", "1", "--max-num-seqs", "1")
    try:
        yield main.wait(), small.wait()
    finally:
        main.stop()
        small.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _events(response: httpx.Response) -> list:
    """The JSON events of an SSE response, then "[DONE]" if it came."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_the_openai_client_works_unchanged(client, artifact):
    model = client.models.list().data[0].id
    assert model == Path(artifact).name

    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
    text = plain.choices[0].text
    assert len(text) > 20 and plain.choices[0].finish_reason == "length"
    assert plain.usage.completion_tokens == 24 and plain.usage.total_tokens == plain.usage.prompt_tokens + 24

    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24

    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tell a story."}],
                                          max_tokens=16, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    streamed = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tell a story."}],
                                                   max_tokens=16, temperature=0, stream=True))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat.choices[0].message.content

    # n=2, seeded: choice j samples with seed + j, so the same request gives the same two texts again
    first = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=1.0, n=2, seed=7)
    again = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=1.0, n=2, seed=7)
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.usage.completion_tokens == 32

    # a stop string: the text is cut before it, and it never reaches a stream either
    stop = text.split()[3]
    cut = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed_cut = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                             stream=True)
    assert "".join(c.choices[0].text for c in streamed_cut) == cut.choices[0].text


def test_greedy_completion_is_engine_generate_and_the_cli(server, artifact, cli):
    from kiln import runtime

    engine = runtime.load(artifact)
    paragraph = EVAL_TEXT.read_text().split("\n\n")[3].strip()
    prompts = [PROMPT, " ".join(paragraph.split()[:40])]
    for prompt, max_tokens in zip(prompts, (40, 25), strict=True):
        expected = engine.generate(prompt, max_tokens, temperature=0)[0].text
        got = server.post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["text"] == expected
        code, out, _ = cli("generate", artifact, prompt, "--max-new-tokens", str(max_tokens))
        assert code == 0 and out == prompt + expected + "\n"


def test_a_full_queue_answers_429_with_retry_after(servers):
    _, small = servers  # one sequence runs, one waits: the others are refused
    results = []

    def fire():
        results.append(small.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True}))

    threads = [threading.Thread(target=fire) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in results)
    assert codes.count(200) >= 1 and codes.count(429) >= 1 and set(codes) <= {200, 429}, codes
    for r in results:
        if r.status_code == 429:
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["code"] == "queue_full"
        else:
            assert r.json()["usage"]["completion_tokens"] == 40
    m = small.idle_metrics()
    assert m["kiln_requests_rejected_total"] == codes.count(429)


def test_a_client_that_goes_away_frees_its_blocks(server):
    before = server.metrics()
    with httpx.stream("POST", f"{server.url}/v1/completions", json={"prompt": PROMPT, "stream": True, **LONG},
                      timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        running = server.metrics()
        assert running["kiln_num_requests_running"] == LONG["n"] and running["kiln_kv_cache_usage_ratio"] > 0
    # not streaming: the client gives up after half a second
    with pytest.raises(httpx.ReadTimeout):
        server.post("/v1/completions", {"prompt": PROMPT, **LONG}, timeout=0.5)
    m = server.idle_metrics()
    assert m["kiln_num_requests_running"] == 0 and m["kiln_kv_cache_usage_ratio"] == 0
    key = 'kiln_requests_aborted_total{cause="disconnect"}'
    assert m[key] - before.get(key, 0) == 2 * LONG["n"]  # counted per choice
    assert m["kiln_generation_tokens_total"] - before["kiln_generation_tokens_total"] < 2 * LONG["n"] * LONG["max_tokens"]


def test_a_request_past_the_timeout_is_aborted(server):
    start = time.monotonic()
    late = server.post("/v1/completions", {"prompt": PROMPT, **LONG})
    assert late.status_code == 504 and late.json()["error"]["code"] == "request_timeout"
    assert time.monotonic() - start < 4
    with httpx.stream("POST", f"{server.url}/v1/completions", json={"prompt": PROMPT, "stream": True, **LONG},
                      timeout=30) as response:
        events = _events(response)
    assert events[-2]["error"]["code"] == "request_timeout" and events[-1] == "[DONE]"
    m = server.idle_metrics()
    assert m["kiln_num_requests_running"] == 0 and m["kiln_kv_cache_usage_ratio"] == 0
    assert m['kiln_requests_aborted_total{cause="timeout"}'] == 2 * LONG["n"]


def test_metrics_and_bad_requests(server, client):
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("kiln_time_to_first_token_seconds_bucket", "kiln_time_per_output_token_seconds_bucket",
                 "kiln_e2e_request_latency_seconds_bucket", "kiln_num_requests_waiting", "kiln_num_requests_running",
                 "kiln_kv_cache_usage_ratio", "kiln_prefix_cache_hit_rate", "kiln_request_success_total",
                 "kiln_requests_rejected_total", "kiln_prompt_tokens_total", "kiln_generation_tokens_total",
                 "kiln_preemptions_total"):
        assert f"\n{name}" in text, name
    assert 'kiln_request_success_total{finish_reason="length"}' in text

    bad = [({"prompt": PROMPT, "max_tokens": "many"}, "max_tokens"),
           ({"prompt": PROMPT, "max_tokens": 5000}, "max_tokens"),
           ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
           ({"prompt": ""}, "prompt"),
           ({"prompt": []}, "prompt"),
           ({"prompt": [100000]}, "prompt"),
           ({"prompt": PROMPT, "logprobs": 1}, "logprobs"),
           ({"prompt": PROMPT, "echo": True}, "echo"),
           ({"prompt": PROMPT, "best_of": 3}, "best_of"),
           ({"prompt": PROMPT, "suffix": "The end."}, "suffix"),
           ({"prompt": PROMPT, "temperature": 7}, "temperature"),
           ({"prompt": PROMPT, "n": 0}, "n"),
           ({"prompt": PROMPT, "top_p": 0}, "top_p"),
           ({"prompt": PROMPT, "seed": 2**70}, "seed"),
           ({"prompt": PROMPT, "model": "another-model"}, "model"),
           ({"max_tokens": 4}, "prompt")]
    for body, param in bad:
        r = server.post("/v1/completions", body)
        assert r.status_code == (404 if param == "model" else 400), (body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, (body, error)
    chat_bad = [{"messages": []}, {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
                {"messages": "hi"}]
    for body in chat_bad:
        r = server.post("/v1/chat/completions", body)
        assert r.status_code == 400 and "error" in r.json(), r.text
    r = httpx.post(f"{server.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"

    import openai

    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, echo=True)


def test_sigterm_drains_in_flight_requests_then_exits_0(servers):
    _, small = servers
    result = {}

    def long_stream():
        with httpx.stream("POST", f"{small.url}/v1/completions", timeout=60,
                          json={"prompt": PROMPT, "stream": True, "max_tokens": 480, "ignore_eos": True,
                                "stream_options": {"include_usage": True}}) as response:
            result["events"] = _events(response)

    thread = threading.Thread(target=long_stream)
    thread.start()
    end = time.monotonic() + 10
    while small.metrics()["kiln_num_requests_running"] < 1 and time.monotonic() < end:
        time.sleep(0.02)
    small.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    refused = small.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    assert httpx.get(f"{small.url}/health").status_code == 503
    thread.join(timeout=60)
    events = result["events"]
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 480
    assert small.proc.wait(timeout=30) == 0
    with pytest.raises(httpx.TransportError):  # the socket is closed
        httpx.get(f"{small.url}/health", timeout=2)


def test_a_failed_step_fails_its_requests_and_serving_goes_on(artifact):
    """In-process: the engine thread catches a step that raises, fails the requests it ran (blocks freed) and
    serves the next request."""
    import asyncio

    from kiln import runtime
    from kiln.runtime.engine_loop import EngineLoop
    from kiln.runtime.request import SamplingParams
    from kiln.runtime.scheduler import Scheduler
    from kiln.runtime.server_metrics import ServerMetrics

    engine = runtime.load(artifact)
    scheduler = Scheduler(engine, max_num_seqs=4, num_blocks=64)
    forward, calls = scheduler._forward, []

    def failing_once(plan):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return forward(plan)

    scheduler._forward = failing_once
    lines: list[str] = []
    engine_loop = EngineLoop(scheduler, ServerMetrics(), lines.append)
    ids = engine.tokenizer(PROMPT)["input_ids"]

    async def run():
        engine_loop.start(asyncio.get_running_loop())
        queue: asyncio.Queue = asyncio.Queue()
        engine_loop.submit(ids, SamplingParams(max_tokens=5), queue, 0)
        _, failed = await asyncio.wait_for(queue.get(), 30)
        engine_loop.submit(ids, SamplingParams(max_tokens=5, stop_ids=()), queue, 1)
        texts = []
        while True:
            index, delta = await asyncio.wait_for(queue.get(), 30)
            texts.append(delta.text)
            if delta.finished:
                return failed, index, delta, "".join(texts)

    try:
        failed, index, last, text = asyncio.run(run())
    finally:
        engine_loop.stop()
    assert failed.finished and "RuntimeError" in failed.error
    assert len(lines) == 1 and "injected" in lines[0] and "\n" not in lines[0]
    assert (index, last.finish_reason, last.completion_tokens, last.error) == (1, "length", 5, None)
    assert text == engine.generate(PROMPT, 5)[0].text
    assert scheduler.cache.num_used_blocks == 0


def test_chat_messages_use_the_chat_template_when_there_is_one(artifact):
    from kiln import runtime
    from kiln.runtime.openai_api import ChatMessage
    from kiln.runtime.serving_state import ServerConfig, ServingState

    engine = runtime.load(artifact)
    lines: list[str] = []
    state = ServingState(engine, ServerConfig(num_blocks=8), "m", lines.append)
    messages = [ChatMessage(role="system", content="Be kind."),
                ChatMessage(role="user", content=[{"type": "text", "text": "Hi"}])]
    tok = engine.tokenizer
    assert state.chat_prompt(messages) == tok("system: Be kind.\nuser: Hi\nassistant:")["input_ids"]  # fallback
    state.chat_prompt(messages)
    assert len(lines) == 1 and "warning: m has no chat template" in lines[0]  # said once, not per request
    tok.chat_template = ("{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}"
                         "{% if add_generation_prompt %}[assistant]{% endif %}")
    expected = tok("[system] Be kind. [user] Hi [assistant]", add_special_tokens=False)["input_ids"]
    assert state.chat_prompt(messages) == expected


def _four_prompts() -> list[str]:
    """The first words of four evaluation paragraphs, of four lengths."""
    paragraphs = [p.strip() for p in EVAL_TEXT.read_text().split("\n\n")[:4]]
    return [" ".join(p.split()[:n]) for p, n in zip(paragraphs, (30, 12, 40, 20), strict=True)]


def _complete_at_once(server: Server, prompts: list[str], max_tokens: int) -> list[str]:
    """Greedy completions of `prompts`, sent together from four threads: their texts in prompt order."""
    import concurrent.futures

    with httpx.Client(timeout=60) as http, concurrent.futures.ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda p: http.post(f"{server.url}/v1/completions", json={
            "prompt": p, "max_tokens": max_tokens, "temperature": 0}).json()["choices"][0]["text"], prompts))


def test_speculative_serving_gives_the_same_greedy_text_and_counts_its_drafts(artifact, tmp_path, cli):
    """`serve --speculative --draft prompt-lookup`: greedy completions (one alone, then four at once) are plain
    decoding's; /metrics counts verifications, drafts and acceptances. A drafter the artifact lacks is one line."""
    from kiln import runtime

    engine = runtime.load(artifact)
    prompts = _four_prompts()
    expected = [engine.generate(p, 48, temperature=0)[0].text for p in prompts]
    server = Server(artifact, tmp_path, "--speculative", "--draft", "prompt-lookup", "--draft-tokens", "3").wait()
    try:
        got = server.post("/v1/completions", {"prompt": prompts[0], "max_tokens": 48, "temperature": 0})
        assert got.json()["choices"][0]["text"] == expected[0]
        assert _complete_at_once(server, prompts, 48) == expected
        m = server.idle_metrics()
        assert m["kiln_spec_decode_num_verifications_total"] > 0
        assert 0 < m["kiln_spec_decode_num_accepted_tokens_total"] <= m["kiln_spec_decode_num_draft_tokens_total"]
        by_position = [m.get(f'kiln_spec_decode_num_accepted_tokens_per_pos_total{{position="{j}"}}', 0)
                       for j in range(5)]
        assert sum(by_position) == m["kiln_spec_decode_num_accepted_tokens_total"]  # each acceptance at one position
        assert "speculative decoding: PromptLookupDrafter, up to 3 drafts a step" in server.logs()
    finally:
        server.stop()
    code, _, stderr = cli("serve", artifact, "--speculative", "--draft", "head")
    assert code != 0 and "no draft head" in stderr and stderr.strip().count("\n") == 0


def test_by_default_serve_compiles_its_decode_step_in_the_background_and_keeps_its_tokens(artifact, tmp_path):
    """The CPU default (`--compile auto`): /health answers while the step is still eager, the compile runs on a
    second thread and swaps in (health and /metrics say so), and greedy completions and concurrent ones are the
    same text before and after."""
    prompts = _four_prompts()
    server = Server(artifact, tmp_path, "--compile", "auto").wait()
    try:
        assert httpx.get(f"{server.url}/health", timeout=5).json() == {"status": "ok", "decode": "eager"}
        eager = _complete_at_once(server, prompts, 40)
        end = time.monotonic() + 300
        while httpx.get(f"{server.url}/health", timeout=5).json()["decode"] != "compiled":
            assert time.monotonic() < end, f"not compiled in 300 s: {server.logs()}"
            time.sleep(0.5)
        assert server.metrics()["kiln_decode_compiled"] == 1
        assert _complete_at_once(server, prompts, 40) == eager
        logs = server.logs()
        assert "compiling the decode step in the background" in logs and "decode step compiled in" in logs
    finally:
        server.stop()
    assert server.proc.returncode == 0


@pytest.mark.parametrize("seconds", [0.5, 6])
def test_sigterm_during_the_background_compile_exits_0(artifact, tmp_path, seconds):
    """A server stopped while its decode step still compiles drains and exits 0 (the compile thread, inside
    torch's C++ code at that moment, used to crash the interpreter's teardown)."""
    server = Server(artifact, tmp_path, "--compile", "background").wait()
    time.sleep(seconds)
    assert httpx.get(f"{server.url}/health", timeout=5).json()["decode"] == "eager"  # still compiling
    server.stop()
    assert server.proc.returncode == 0, server.logs()
    assert "decode step compiled" not in server.logs()
