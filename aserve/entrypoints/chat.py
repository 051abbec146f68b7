"""OpenAI chat completions: the wire types, the checkpoint's (or a given) Jinja chat template
rendered as `transformers`' apply_chat_template does, and the chat shape of responses.

A chat request becomes a completions request over the rendered prompt's token ids; no
aiohttp and no engine here.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Annotated, Literal

import jinja2
import jinja2.ext
import msgspec
from jinja2.sandbox import ImmutableSandboxedEnvironment
from msgspec import Meta

from aserve.entrypoints.protocol import (
    MAX_N,
    Choice,
    CompletionRequest,
    Logprobs,
    RequestError,
    StreamOptions,
    Usage,
    decode_json,
)

# Built-in templates for base models without one (`--chat-template NAME`).
CHAT_TEMPLATES = {
    "chatml": ("{% for message in messages %}"
               "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
               "{{ '<|im_end|>' + '\n' }}"
               "{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    "plain": ("{% for message in messages %}"
              "{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n"
              "{% endfor %}"
              "{% if add_generation_prompt %}Assistant:{% endif %}"),
}
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")
OPT_SPECIAL_TOKENS = {"bos_token": "</s>", "eos_token": "</s>", "unk_token": "<unk>",
                      "pad_token": "<pad>"}  # a preset's names, as OPT's tokenizer_config
NO_TEMPLATE = ("model {model!r} has no chat template (none in its tokenizer_config.json or "
               "chat_template.jinja): start the server with --chat-template FILE (a Jinja "
               "template) or NAME (one of: " + ", ".join(CHAT_TEMPLATES) + ")")


class TextPart(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One part of a message's content; only text parts are supported."""

    type: Literal["text"]
    text: str


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One message of the conversation (tool calls are not supported)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as vLLM does)."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The body of `POST /v1/chat/completions` (OpenAI, plus the vLLM extras of completions).

    A field not listed here is a 400 naming it."""

    model: str
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None  # null: up to the context
    max_tokens: Annotated[int, Meta(ge=1)] | None = None  # the older name of the above
    temperature: Annotated[float, Meta(ge=0)] = 1.0
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = -1
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False  # the chosen tokens' logprobs
    top_logprobs: Annotated[int, Meta(ge=0, le=0)] | None = None  # alternatives: unsupported
    presence_penalty: Annotated[float, Meta(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0)] = 1.0
    logit_bias: dict[str, Annotated[float, Meta(ge=-100, le=100)]] | None = None
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Meta(ge=0)]] | None = None
    add_generation_prompt: bool = True  # vLLM: end the prompt with the assistant's turn
    user: str | None = None

    def to_completion(self, prompt: list[int]) -> CompletionRequest:
        """The completions request that generates this chat's answer to `prompt`."""
        return CompletionRequest(
            model=self.model, prompt=prompt,  # type: ignore[arg-type]
            max_tokens=self.max_completion_tokens or self.max_tokens, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, n=self.n, seed=self.seed, stop=self.stop,
            stream=self.stream, stream_options=self.stream_options,
            logprobs=0 if self.logprobs else None, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_token_ids, user=self.user)


def decode_chat_request(body: bytes) -> ChatCompletionRequest:
    """Parses and validates a JSON body; raises RequestError naming the bad field."""
    req = decode_json(body, ChatCompletionRequest)
    if req.stream_options is not None and not req.stream:
        raise RequestError("stream_options is only allowed with stream=true", "stream_options")
    return req


class TokenizeRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The body of vLLM's `POST /v1/tokenize`: a prompt, or a chat rendered by the template."""

    model: str | None = None  # the served model name; null: the served model
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompt: prepend BOS, as completions do
    add_generation_prompt: bool = True  # messages: end with the assistant's turn


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag) renders
    its body; the mask itself is not needed to serve."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(
            lineno)

    def _render(self, caller: jinja2.runtime.Macro) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class ChatTemplate:
    """A Jinja chat template compiled as transformers compiles it (sandboxed, trim_blocks,
    lstrip_blocks, loop controls, `tojson`, `raise_exception`, `strftime_now`)."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source
        self.template = env.from_string(source)
        self.special_tokens = special_tokens or dict(OPT_SPECIAL_TOKENS)

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool) -> str:
        """The prompt text; a template error (e.g. `raise_exception`) is a 400."""
        chat = [{"role": m.role, "content": m.text, **({"name": m.name} if m.name else {})}
                for m in messages]
        try:
            return self.template.render(messages=chat, tools=None, documents=None,
                                        add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens)
        except jinja2.exceptions.TemplateError as exc:
            raise RequestError(f"the chat template rejected the messages: {exc}",
                               "messages") from exc


def load_chat_template(name_or_file: str | None, model_dir: str | None) -> ChatTemplate | None:
    """`--chat-template` (a built-in NAME or a FILE), else the checkpoint's own template
    (chat_template.jinja, chat_template.json or tokenizer_config.json; a GGUF file's
    `tokenizer.chat_template`), else None.

    Raises:
        ValueError: `name_or_file` is neither a built-in name nor a readable file.
    """
    special = _special_tokens(model_dir)
    if name_or_file is not None:
        if name_or_file in CHAT_TEMPLATES:
            return ChatTemplate(CHAT_TEMPLATES[name_or_file], special)
        path = Path(name_or_file)
        if not path.is_file():
            raise ValueError(f"chat_template ({name_or_file!r}) is neither a file nor one of: "
                             + ", ".join(CHAT_TEMPLATES))
        return ChatTemplate(path.read_text(encoding="utf-8"), special)
    source = None if model_dir is None else (
        _gguf().chat_template(model_dir) if model_dir.endswith(".gguf")
        else _checkpoint_template(Path(model_dir)))
    return None if source is None else ChatTemplate(source, special)


def _checkpoint_template(directory: Path) -> str | None:
    for name in TEMPLATE_FILES:
        path = directory / name
        if not path.is_file():
            continue
        if name.endswith(".jinja"):
            return path.read_text(encoding="utf-8")
        template = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = {t["name"]: t["template"] for t in template}.get("default")
        if isinstance(template, str):
            return template
    return None


def _gguf():  # type: ignore[no-untyped-def]
    """models.gguf_loader, imported on demand (it loads the gguf library and torch)."""
    from models import gguf_loader

    return gguf_loader


def _special_tokens(model_dir: str | None) -> dict[str, str]:
    """bos/eos/unk/pad token strings the template may use, from tokenizer_config.json (or a
    GGUF file's metadata)."""
    tokens = dict(OPT_SPECIAL_TOKENS)
    if model_dir is not None and model_dir.endswith(".gguf"):
        return {**tokens, **_gguf().special_tokens(model_dir)}
    path = Path(model_dir) / "tokenizer_config.json" if model_dir is not None else None
    if path is None or not path.is_file():
        return tokens
    config = json.loads(path.read_text(encoding="utf-8"))
    for key in tokens:
        value = config.get(key)
        if isinstance(value, dict):  # an AddedToken: {"content": "<s>", ...}
            value = value.get("content")
        if isinstance(value, str):
            tokens[key] = value
    return tokens


# -- responses -----------------------------------------------------------------------------
class ChatLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[dict[str, object]] = []


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatLogprob]


class Delta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChoice(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One answer: `message` in a whole response, `delta` in a streamed chunk."""

    index: int
    message: Delta | None = None
    delta: Delta | None = None
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct, kw_only=True):
    """A chat response (`object` "chat.completion") or one streamed chunk of it
    ("chat.completion.chunk"); `usage` is null in chunks unless asked for."""

    id: str
    object: Literal["chat.completion", "chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None


def _chat_logprobs(logprobs: Logprobs | None) -> ChatLogprobs | None:
    if logprobs is None:
        return None
    return ChatLogprobs(content=[
        ChatLogprob(token=t, logprob=lp, bytes=list(t.encode("utf-8")))
        for t, lp in zip(logprobs.tokens, logprobs.token_logprobs) if lp is not None])


class ChatFormat:
    """Completion choices in the chat shape; the first chunk of each choice names the role."""

    def __init__(self) -> None:
        self.has_role: set[int] = set()

    def body(self, cmpl_id: str, created: int, model: str, choices: list[Choice],
             usage: Usage) -> bytes:
        return msgspec.json.encode(ChatCompletion(
            id=cmpl_id, object="chat.completion", created=created, model=model, usage=usage,
            choices=[ChatChoice(index=c.index, message=Delta(role="assistant", content=c.text),
                                logprobs=_chat_logprobs(c.logprobs),
                                finish_reason=c.finish_reason) for c in choices]))

    def chunk(self, cmpl_id: str, created: int, model: str, choices: list[Choice],
              usage: Usage | None = None) -> bytes:
        out = []
        for c in choices:
            role = None if c.index in self.has_role else "assistant"
            self.has_role.add(c.index)
            out.append(ChatChoice(index=c.index, delta=Delta(role=role, content=c.text),
                                  logprobs=_chat_logprobs(c.logprobs),
                                  finish_reason=c.finish_reason))
        return msgspec.json.encode(ChatCompletion(
            id=cmpl_id, object="chat.completion.chunk", created=created, model=model,
            choices=out, usage=usage))


def chat_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"
