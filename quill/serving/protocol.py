"""OpenAI request models (pydantic) and the error schema, shared by every host of the API.

Field names, defaults and bounds are OpenAI's; vLLM's extra sampling fields (``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``) are
accepted too.  Unknown fields are ignored, as vLLM does; fields quill cannot honour
(``suffix``) are refused by name.  Structured outputs (``response_format`` and the rest) and
``logit_bias``: ``protocol_structured``.  Tools: ``protocol_tools``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from quill.engine.sampling import REPETITION_PENALTY, SEED_MAX, SEED_MIN, SamplingParams
from quill.errors import QuillError
from quill.serving.protocol_structured import StructuredFields, logit_bias
from quill.serving.protocol_tools import Tool, ToolCallIn, ToolChoice, check_tools
from quill.tokenizer import TEMPLATE_OWN_VARIABLES

ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(QuillError):
    """An error answered in OpenAI's schema: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


# JSON numbers; ints are accepted for floats (OpenAI does); NaN / Infinity (which Python's json reads) are not
Float = Annotated[float, Field(strict=False, allow_inf_nan=False)]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Sampling(StructuredFields):
    """Fields both endpoints share (the structured-output ones: ``protocol_structured``)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: StrictStr | None = None
    n: StrictInt = Field(1, ge=1, le=64)
    temperature: Float | None = Field(None, ge=0.0)
    top_p: Float | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=-1)
    min_p: Float | None = Field(None, ge=0.0, le=1.0)
    seed: StrictInt | None = Field(None, ge=SEED_MIN, le=SEED_MAX)  # what torch's generators take
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    presence_penalty: Float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: Float | None = Field(None, ge=REPETITION_PENALTY[0], le=REPETITION_PENALTY[1])
    min_tokens: StrictInt = Field(0, ge=0)
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Float] | None = None
    user: StrictStr | None = None

    def refuse_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if self.seed is not None and self.seed + self.n - 1 > SEED_MAX:
            raise bad_request(f"seed: choice i of n samples with seed + i, and {self.seed} + {self.n - 1} is above "
                              f"the largest seed, {SEED_MAX}", "seed")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None,
                        index: int = 0) -> SamplingParams:
        """The engine's parameters for choice ``index`` (n > 1: seed + index, so choices differ reproducibly)."""
        seed = None if self.seed is None else self.seed + index
        return SamplingParams(
            max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=self.top_k or 0, top_p=1.0 if self.top_p is None else self.top_p, min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, structured_outputs=self.structured(),
            logit_bias=logit_bias(self.logit_bias))

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


Prompt = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: Prompt
    max_tokens: StrictInt | None = Field(16, ge=1)
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.suffix:
            raise bad_request("suffix is not supported by quill", "suffix", "unsupported_parameter")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request(f"best_of other than n is not supported by quill (found best_of={self.best_of}, "
                              f"n={self.n})", "best_of", "unsupported_parameter")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: StrictStr
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls
    tool_call_id: StrictStr | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    response_format: dict[str, Any] | None = None
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None  # more template variables (vLLM's field): enable_thinking

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if not self.messages:
            raise bad_request("messages must contain at least one message", "messages")
        for i, m in enumerate(self.messages):
            if m.role not in ROLES:
                raise bad_request(f"messages[{i}].role '{m.role}' is not supported; supported: "
                                  f"{', '.join(ROLES)}", f"messages[{i}].role")
        check_tools(self.tools, self.tool_choice)
        clash = sorted(set(self.chat_template_kwargs or ()) & TEMPLATE_OWN_VARIABLES)
        if clash:
            raise bad_request(f"chat_template_kwargs may not set {', '.join(clash)}: they are this request's own "
                              "fields", "chat_template_kwargs")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict]:
        """The messages as chat templates expect them (``developer`` is the newer name of ``system``)."""
        return [_template_message(m) for m in self.messages]

    @property
    def offered_tools(self) -> list[dict] | None:
        """The tools the model is told about (none with ``tool_choice: "none"``)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.template_form() for t in self.tools]


def _template_message(m: ChatMessage) -> dict:
    out = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.tool_calls:
        out["content"] = m.text() if m.content is not None else None  # templates tell "" from no text
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out
