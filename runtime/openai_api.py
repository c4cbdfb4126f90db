"""The OpenAI API's shapes as this server speaks them: request bodies (pydantic), errors, and response bodies.

    body = CompletionRequest.model_validate({"prompt": "Once upon a time", "max_tokens": 8})
    raise ApiError(404, "the model 'x' does not exist", "invalid_request_error", "model", "model_not_found")
    chunk("m", "cmpl-1", created, False, [{"index": 0, "text": "Once", ...}])   # 'data: {...}\n\n'
    completion_body("m", "cmpl-1", created, False, ["Once upon"], ["length"], 5, 2)   # a whole answer

An error is answered as OpenAI does: {"error": {"message", "type", "param", "code"}}. Request bodies accept
unknown fields (OpenAI's server ignores them); request_validation refuses the ones Kiln cannot honour.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr


# --- errors ----------------------------------------------------------------------------------------------------
class ApiError(Exception):
    """An HTTP error answered as OpenAI does: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


OPENAI_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # the scheduler's finish reason -> OpenAI's


# --- request bodies --------------------------------------------------------------------------------------------
Number = StrictFloat | StrictInt


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


class SamplingFields(BaseModel):
    """The sampling options both endpoints take. Unknown fields (user, metadata, ...) are accepted and ignored as
    OpenAI's server ignores them; the options that would change the output and that Kiln cannot honour are
    refused by request_validation.refuse_unsupported."""

    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    n: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False  # vLLM's extension: run to max_tokens through EOS
    repetition_penalty: Number | None = None  # extension; None: the artifact's default


class CompletionRequest(SamplingFields):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None


class ChatRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None


# --- response bodies -------------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj) -> str:
    """One server-sent event: `obj` as compact JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"



DONE = "data: [DONE]\n\n"  # a stream's last event


def stream_error(exc: ApiError) -> str:
    """A stream's error event, and its end."""
    return sse(exc.body()) + DONE


def chunk(model_id: str, rid: str, created: int, chat: bool, choices: list, usage=None,
          include_usage: bool = False) -> str:
    """One streamed chunk as an event; with `include_usage` it carries a "usage" field (null but in the last)."""
    obj = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
           "model": model_id, "choices": choices}
    if include_usage:
        obj["usage"] = usage
    return sse(obj)


def completion_body(model_id: str, rid: str, created: int, chat: bool, texts: list[str], finish_reasons: list,
                    prompt_tokens: int, completion_tokens: int) -> dict:
    """A whole (non-streamed) completion: choice i is `texts[i]`, finished for the scheduler's `finish_reasons[i]`."""
    out = []
    for index, (text, finish) in enumerate(zip(texts, finish_reasons, strict=True)):
        reason = OPENAI_FINISH.get(finish, "stop")
        if chat:
            out.append({"index": index, "message": {"role": "assistant", "content": text},
                        "logprobs": None, "finish_reason": reason})
        else:
            out.append({"index": index, "text": text, "logprobs": None, "finish_reason": reason})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model_id, "choices": out, "usage": usage(prompt_tokens, completion_tokens)}
