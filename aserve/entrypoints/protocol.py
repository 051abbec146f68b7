"""The OpenAI completions wire format as msgspec types: request validation, responses, errors.

The same Struct validates a body and names the offending field in the 400; it also generates
/openapi.json. No aiohttp and no engine here.
"""

from __future__ import annotations

import itertools
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Annotated, Literal, Protocol, TypeVar

import msgspec
from msgspec import Meta

from aserve.engine.sequence import RequestOutput, SamplingParams

MAX_LOGPROBS = 5  # OpenAI's limit on `logprobs` for completions
PromptItem = str | int | list[int]  # an element of a prompt list: a token id or a batch entry
Prompt = str | list[int]  # one prompt after normalisation
MAX_N = 32  # most completions per prompt (`n`, `best_of`)
T = TypeVar("T")
_PATH = re.compile(r"at `\$\.([A-Za-z_]+)")  # the top-level field of a nested error
_FIELD = re.compile(r"(?:missing required|unknown) field `([A-Za-z_]+)`")  # at the top level


class StreamOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`stream_options`: extra streaming behaviour."""

    include_usage: bool = False  # send a last chunk with `usage` and no choices


class CompletionRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The body of `POST /v1/completions` (OpenAI legacy completions, plus vLLM extras).

    A field not listed here is a 400 naming it: nothing a client sends is silently ignored."""

    model: str  # the served model name, see GET /v1/models
    prompt: str | list[PromptItem]  # text, token ids, or a list of either (a batch)
    max_tokens: Annotated[int, Meta(ge=1)] | None = 16  # per prompt; null: up to the context
    temperature: Annotated[float, Meta(ge=0)] = 1.0  # 0 means greedy
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0  # nucleus probability mass
    top_k: Annotated[int, Meta(ge=-1)] = -1  # -1 or 0: off
    seed: int | None = None  # same seed, same tokens
    stop: str | list[str] | None = None  # up to 4 strings that end generation (not returned)
    ignore_eos: bool = False  # keep generating past EOS
    min_tokens: Annotated[int, Meta(ge=0)] = 0  # EOS and stop strings ignored before this
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None  # chosen-token logprobs
    echo: bool = False  # the choice starts with the prompt (with logprobs: and its logprobs)
    stream: bool = False  # server-sent events, ending with `data: [DONE]`
    stream_options: StreamOptions | None = None  # only with stream=true
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1  # completions per prompt
    best_of: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None  # samples to rank; >= n
    suffix: str | None = None  # unsupported: must be null
    presence_penalty: Annotated[float, Meta(ge=-2, le=2)] = 0.0  # once per generated token
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2)] = 0.0  # per occurrence in output
    repetition_penalty: Annotated[float, Meta(gt=0)] = 1.0  # vLLM: prompt and output tokens
    logit_bias: dict[str, Annotated[float, Meta(ge=-100, le=100)]] | None = None  # id -> bias
    stop_token_ids: list[Annotated[int, Meta(ge=0)]] | None = None  # vLLM: ids that end it
    user: str | None = None  # an end-user id for the client's records; not used


class DetokenizeRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The body of vLLM's `POST /v1/detokenize`."""

    model: str | None = None  # the served model name; null: the served model
    tokens: list[int]


class Logprobs(msgspec.Struct, kw_only=True):
    """OpenAI's completions `logprobs` object. Only the chosen tokens' logprobs are known,
    so `top_logprobs` is null; `text_offset` counts characters of the choice's text (with
    echo, from the prompt's start), as the running sum of the decoded token strings."""

    tokens: list[str]
    token_logprobs: list[float | None]  # null for the first prompt token (echo)
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class Choice(msgspec.Struct, kw_only=True):
    """One completion (`index` is the prompt's position in a batch)."""

    text: str
    index: int
    logprobs: Logprobs | None
    finish_reason: str | None


class Usage(msgspec.Struct, kw_only=True):
    """Token counts of a whole request (all prompts of a batch)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Completion(msgspec.Struct, kw_only=True):
    """A completion response, or one server-sent chunk of a streamed one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None


class ErrorBody(msgspec.Struct, kw_only=True):
    """The inside of OpenAI's error envelope."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    """OpenAI's error envelope: `{"error": {...}}`."""

    error: ErrorBody


class RequestError(ValueError):
    """Bad client input with the HTTP status and the field it concerns."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def decode_request(body: bytes) -> CompletionRequest:
    """Parses and validates a JSON body; raises RequestError naming the bad field."""
    req = decode_json(body, CompletionRequest)
    check_supported(req)
    return req


def decode_json(body: bytes, type_: type[T]) -> T:
    """`body` decoded as `type_`; raises RequestError naming the bad field."""
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        raise RequestError(f"invalid request: {exc}", param=param_of(str(exc))) from exc
    except msgspec.DecodeError as exc:
        raise RequestError(f"the body is not valid JSON: {exc}", param="body") from exc
    except RecursionError as exc:  # e.g. [[[[…]]]] thousands deep in a field that is skipped
        raise RequestError(f"the body is nested too deeply: {exc}", param="body") from exc


def check_supported(req: CompletionRequest) -> None:
    """Rejects fields we parse but do not implement, rather than ignoring them."""
    unsupported = [
        ("best_of", req.best_of is not None and req.best_of < req.n,
         f"best_of ({req.best_of}) must be >= n ({req.n})"),
        ("best_of", req.best_of is not None and req.best_of > req.n and req.stream,
         "best_of > n cannot be streamed: the best samples are known only at the end"),
        ("suffix", req.suffix is not None, "suffix is not supported"),
        ("stream_options", req.stream_options is not None and not req.stream,
         "stream_options is only allowed with stream=true"),
    ]
    for param, is_bad, message in unsupported:
        if is_bad:
            raise RequestError(message, param=param)


def param_of(message: str) -> str | None:
    """The top-level field a msgspec error path (`... - at `$.field[0]``) points at, else
    the field a top-level error names."""
    match = _PATH.search(message) or _FIELD.search(message)
    return match.group(1) if match else None


def prompts_of(req: CompletionRequest) -> list[Prompt]:
    """The request's prompts: a text, a token-id list, or a batch of either."""
    prompt = req.prompt
    if isinstance(prompt, str) or all(isinstance(p, int) for p in prompt):
        prompts: list[Prompt] = [prompt]  # type: ignore[list-item]
    elif any(isinstance(p, int) for p in prompt):
        raise RequestError("prompt mixes token ids with strings or lists; send either a list "
                           "of token ids or a list of prompts", param="prompt")
    else:
        prompts = list(prompt)  # type: ignore[arg-type]
    for i, p in enumerate(prompts):
        if not p:
            where = f" (prompt {i} of the batch)" if len(prompts) > 1 else ""
            raise RequestError(f"prompt must not be empty{where}", param="prompt")
    return prompts


def sampling_params(req: CompletionRequest, max_tokens: int) -> SamplingParams:
    """The engine's SamplingParams for a request (`max_tokens` resolved by the caller when
    the body sent null); raises RequestError on bad values."""
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    try:
        return SamplingParams(
            max_tokens=max_tokens, min_tokens=req.min_tokens, temperature=req.temperature,
            top_p=req.top_p, top_k=req.top_k, seed=req.seed, stop=stop,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos, logprobs=req.logprobs is not None,
            prompt_logprobs=req.echo and req.logprobs is not None,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, logit_bias=_logit_bias(req.logit_bias))
    except ValueError as exc:
        raise RequestError(str(exc), param=_leading_field(str(exc))) from exc


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"token id": bias}` as (id, bias) pairs; the keys must be integers."""
    pairs = []
    for key, value in (bias or {}).items():
        try:
            pairs.append((int(key), value))
        except ValueError:
            raise RequestError(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
    return tuple(sorted(pairs))


def _leading_field(message: str) -> str | None:
    head = message.split(" ", 1)[0]
    return head if head in CompletionRequest.__struct_fields__ else None


def clip(text: str, limit: int = 64) -> str:
    """A client's value as an error message echoes it: at most `limit` characters."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def now() -> int:
    """Wall-clock seconds for `created`."""
    return int(time.time())


def error_json(message: str, type_: str, param: str | None = None,
               code: str | None = None) -> bytes:
    return msgspec.json.encode(ErrorResponse(error=ErrorBody(
        message=message, type=type_, param=param, code=code)))


def openapi_document(title: str, version: str,
                     extra_requests: Sequence[tuple[str, type, str]] = ()) -> dict[str, object]:
    """An OpenAPI 3.1 description of the routes, with schemas generated from the Structs.

    `extra_requests`: (path, request Struct, summary) of the other POST routes (chat,
    tokenize), described with their request schema and the shared error responses."""
    types = [CompletionRequest, Completion, ErrorResponse, DetokenizeRequest,
             *(t for _, t, _ in extra_requests)]
    refs, components = msgspec.json.schema_components(
        types, ref_template="#/components/schemas/{name}")
    req_ref, resp_ref, err_ref, detok_ref = refs[:4]
    errors = {str(s): {"description": d, "content": {"application/json": {"schema": err_ref}}}
              for s, d in ((400, "invalid request"), (401, "missing or wrong API key"),
                           (404, "unknown model"), (413, "body too large"),
                           (429, "overloaded or over a client's share"),
                           (503, "the engine is unavailable"))}

    def post(summary: str, request_ref: object, response: Mapping[str, object]) -> object:
        return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
            "application/json": {"schema": request_ref}}}, "responses": {"200": response,
                                                                        **errors}}}

    ok = {"description": "OK"}
    paths: dict[str, object] = {"/v1/completions": post(
        "Create a completion (stream=true: server-sent events of Completion chunks)", req_ref,
        {"description": "the completion", "content": {
            "application/json": {"schema": resp_ref},
            "text/event-stream": {"schema": {"type": "string"}}}}),
        "/v1/detokenize": post("The text of token ids (vLLM)", detok_ref, ok)}
    for (path, _, summary), ref in zip(extra_requests, refs[4:]):
        paths[path] = post(summary, ref, ok)
    plain = {"get": {"responses": {"200": ok}}}
    for path in ("/v1/models", "/health", "/ping", "/version", "/metrics"):
        paths[path] = plain
    return {"openapi": "3.1.0", "info": {"title": title, "version": version},
            "paths": paths, "components": {"schemas": components}}


class CompletionFormat:
    """Choices in the completions shape (`ChatFormat` in chat.py is the chat one)."""

    def body(self, cmpl_id: str, created: int, model: str, choices: list[Choice],
             usage: Usage) -> bytes:
        return msgspec.json.encode(Completion(id=cmpl_id, created=created, model=model,
                                              choices=choices, usage=usage))

    def chunk(self, cmpl_id: str, created: int, model: str, choices: list[Choice],
              usage: Usage | None = None) -> bytes:
        return self.body(cmpl_id, created, model, choices, usage)  # type: ignore[arg-type]


class TokenDecoder(Protocol):
    """What ChoiceBuilder needs of a tokenizer."""

    def decode(self, ids: Sequence[int]) -> str: ...


class ChoiceBuilder:
    """Turns one prompt's cumulative outputs into choice deltas: called once with the final
    output it gives the whole choice, called per output it gives the streamed chunks, and
    the chunks concatenate to the whole choice."""

    def __init__(self, index: int, tokenizer: TokenDecoder, has_logprobs: bool,
                 echo: str | None = None) -> None:
        self.index = index
        self.tokenizer = tokenizer
        self.has_logprobs = has_logprobs
        self.echo = echo  # prompt text the choice starts with (`echo`), sent with the first
        self.num_chars = 0  # text already sent
        self.num_tokens = 0  # tokens whose logprobs were already sent
        self.text_offset = 0  # characters of the token strings already sent

    def delta(self, out: RequestOutput) -> Choice:
        text = out.text[self.num_chars:]
        self.num_chars = max(self.num_chars, len(out.text))
        logprobs = self._logprobs(out) if self.has_logprobs else None
        if self.echo is not None:
            text = self.echo + text
            if logprobs is not None:
                logprobs = self._prompt_logprobs(out, logprobs)
            self.echo = None
        return Choice(text=text, index=self.index, logprobs=logprobs,
                      finish_reason=out.finish_reason)

    def _logprobs(self, out: RequestOutput) -> Logprobs:
        token_ids = out.token_ids[self.num_tokens:]
        token_logprobs: list[float | None] = list((out.logprobs or [])[self.num_tokens:])
        tokens = [self.tokenizer.decode([t]) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(token)
        self.num_tokens = len(out.token_ids)
        return Logprobs(tokens=tokens, token_logprobs=token_logprobs, text_offset=offsets)

    def _prompt_logprobs(self, out: RequestOutput, logprobs: Logprobs) -> Logprobs:
        """`logprobs` of the first delta preceded by the prompt's (echo): its first token
        has none, as in OpenAI's and vLLM's answers."""
        tokens = [self.tokenizer.decode([t]) for t in out.prompt_token_ids]
        shift = sum(len(t) for t in tokens)
        offsets = [0, *itertools.accumulate(len(t) for t in tokens[:-1])]
        self.text_offset += shift
        return Logprobs(
            tokens=tokens + logprobs.tokens,
            token_logprobs=[None, *(out.prompt_logprobs or []), *logprobs.token_logprobs],
            text_offset=offsets + [o + shift for o in logprobs.text_offset])
