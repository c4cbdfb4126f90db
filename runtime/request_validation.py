"""Request validation: an OpenAI request body becomes prompts of token ids and one SamplingParams per choice, or
a 400 (ApiError) that names the bad field. Options the runtime cannot honour are refused, never dropped.

    parser = RequestParser(tokenizer, vocab_size=32000, context=4096, max_request_tokens=4096, max_queue=256,
                           model_id="s260k", log=print)
    prompts = parser.completion_prompts(body.prompt)      # or [parser.chat_prompt(body.messages)]
    parsed = parser.parse(body, prompts, chat=False)      # ParsedRequest: prompts, n, params, stream, ...

Prompts are tokenized as `Engine.generate` does (`tokenizer(text)["input_ids"]`). Chat messages go through the
tokenizer's chat template; a tokenizer without one gets FALLBACK_CHAT_FORMAT, and the log says so once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kiln.runtime.openai_api import ApiError, bad_request
from kiln.runtime.scheduler import SamplingParams

FALLBACK_CHAT_FORMAT = "{role}: {content}\n"  # per message; the prompt then ends with "assistant:"
MAX_STOP_STRINGS = 16


def refuse_unsupported(body, chat: bool) -> None:
    """400 for an option that would change the output and that this runtime cannot honour."""
    extra = body.model_extra or {}
    n = body.n or 1

    def given(name: str) -> Any:
        return extra.get(name)

    if given("logprobs") not in (None, False) or given("top_logprobs") not in (None, 0):
        raise bad_request("logprobs are not supported by this server", "logprobs")
    if given("echo"):
        raise bad_request("echo is not supported by this server", "echo")
    if given("best_of") is not None and given("best_of") != n:
        raise bad_request(f"best_of (here {given('best_of')!r}) other than n is not supported", "best_of")
    if given("suffix"):
        raise bad_request("suffix is not supported by this server", "suffix")
    for name in ("tools", "functions", "logit_bias"):
        if given(name):
            raise bad_request(f"{name} is not supported by this server", name)
    if given("tool_choice") not in (None, "none"):
        raise bad_request("tool_choice is not supported by this server", "tool_choice")
    for name in ("presence_penalty", "frequency_penalty"):
        if given(name) not in (None, 0, 0.0):
            raise bad_request(f"{name} is not supported by this server (use repetition_penalty)", name)
    response_format = given("response_format")
    if response_format not in (None, {"type": "text"}):
        raise bad_request("response_format other than text is not supported", "response_format")


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request: its prompts as token ids and each choice's sampling."""

    prompts: list[list[int]]
    n: int
    params: list[Any]  # SamplingParams per choice, prompt-major: index = prompt * n + j
    stream: bool
    include_usage: bool


class RequestParser:
    """What validating a request needs to know of the server: its tokenizer, vocabulary, context, the most tokens
    one request may hold, its queue, and the model's name."""

    def __init__(self, tokenizer, vocab_size: int, context: int, max_request_tokens: int, max_queue: int,
                 model_id: str, log: Callable[[str], None]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context = context
        self.max_request_tokens = max_request_tokens
        self.max_queue = max_queue
        self.model_id = model_id
        self.log = log
        self.warned_no_chat_template = False

    def _tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this artifact has no tokenizer: send prompts as token ids", "prompt")
        return list(self.tokenizer(text)["input_ids"])

    def completion_prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            prompt = [prompt]
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                if not p:
                    raise bad_request("prompt must not be empty", "prompt")
                out.append(self._tokenize(p))
            else:
                if not p:
                    raise bad_request("a token-id prompt must not be empty", "prompt")
                vocab = self.vocab_size
                if min(p) < 0 or max(p) >= vocab:
                    raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
                out.append(list(p))
        return out

    def chat_prompt(self, messages) -> list[int]:
        if not messages:
            raise bad_request("messages must not be empty", "messages")
        plain = []
        for i, message in enumerate(messages):
            content = message.content
            if isinstance(content, list):  # content parts: text only
                texts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise bad_request(f"messages[{i}]: only text content parts are supported", "messages")
                    texts.append(part["text"])
                content = "".join(texts)
            plain.append({"role": message.role, "content": content or ""})
        tok = self.tokenizer
        if tok is None:
            raise bad_request("this artifact has no tokenizer: chat completions need one", "messages")
        if getattr(tok, "chat_template", None):
            try:
                text = tok.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
            except Exception as exc:  # noqa: BLE001 -- a template refusing the messages (roles, order) is theirs
                raise bad_request(f"the chat template refused the messages: {' '.join(str(exc).split())[:200]}",
                           "messages") from None
            return list(tok(text, add_special_tokens=False)["input_ids"])
        if not self.warned_no_chat_template:  # once, in the server log, as vLLM warns of its fallback
            self.warned_no_chat_template = True
            self.log(f"kiln serve: warning: {self.model_id} has no chat template (no chat_template.jinja, none in "
                     "tokenizer_config.json); chat messages are sent as 'role: content' lines followed by "
                     "'assistant:', which the model was not trained on")
        text = "".join(FALLBACK_CHAT_FORMAT.format(**m) for m in plain) + "assistant:"
        return self._tokenize(text)

    def parse(self, body, prompts: list[list[int]], chat: bool) -> ParsedRequest:
        refuse_unsupported(body, chat)
        if body.model is not None and body.model != self.model_id:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server has {self.model_id!r}",
                           "invalid_request_error", "model", "model_not_found")
        n = 1 if body.n is None else body.n
        if n < 1:
            raise bad_request(f"n must be >= 1, got {n}", "n")
        if body.seed is not None and not -(2**63) <= body.seed <= 2**63 - n:  # choice j seeds a generator with seed + j
            raise bad_request(f"seed must be a 64-bit integer, got {body.seed}", "seed")
        if len(prompts) * n > self.max_queue:
            raise bad_request(f"{len(prompts)} prompt(s) x n={n} choices exceed the server's queue of "
                       f"{self.max_queue} requests", "n")
        temperature = 1.0 if body.temperature is None else float(body.temperature)
        if not 0 <= temperature <= 2:
            raise bad_request(f"temperature must be in [0, 2], got {temperature}", "temperature")
        top_p = 1.0 if body.top_p is None else float(body.top_p)
        if not 0 < top_p <= 1:
            raise bad_request(f"top_p must be in (0, 1], got {top_p}", "top_p")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        stop = [s for s in stop if s]
        if len(stop) > MAX_STOP_STRINGS:
            raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", "stop")
        penalty = body.repetition_penalty
        if penalty is not None and not 0 < penalty < float("inf"):
            raise bad_request(f"repetition_penalty must be > 0 (1 = off), got {penalty}", "repetition_penalty")
        max_tokens = body.max_tokens
        if chat and body.max_completion_tokens is not None:
            max_tokens = body.max_completion_tokens
        longest = max(len(p) for p in prompts)
        if longest >= self.max_request_tokens:
            raise bad_request(f"the prompt has {longest} tokens; this server takes at most {self.max_request_tokens - 1} "
                       f"(the model's context is {self.context})", "prompt" if not chat else "messages")
        if max_tokens is None:
            max_tokens = 16 if not chat else self.max_request_tokens - longest
        if max_tokens < 1:
            raise bad_request(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
        if longest + max_tokens > self.max_request_tokens:
            raise bad_request(f"this model's maximum context length is {self.max_request_tokens} tokens; the request asks "
                       f"for {longest + max_tokens} ({longest} in the prompt, {max_tokens} for the completion)",
                       "max_tokens")
        params = []
        for _ in prompts:
            for j in range(n):
                params.append(SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                             seed=None if body.seed is None else body.seed + j, stop=tuple(stop),
                                             stop_ids=() if body.ignore_eos else None,
                                             repetition_penalty=None if penalty is None else float(penalty)))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return ParsedRequest(prompts, n, params, bool(body.stream), include_usage)

