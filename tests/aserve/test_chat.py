"""/v1/chat/completions and vLLM's /v1/tokenize on real servers: chat templates render as
transformers' apply_chat_template renders them (text and token ids), the official `openai`
client gets streamed and whole answers, and a model without a template gets a 400 that says
how to provide one."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from transformers import PreTrainedTokenizerFast

from aserve.engine.config import ServerConfig
from aserve.entrypoints.chat import CHAT_TEMPLATES, ChatMessage, ChatTemplate
from tests.aserve.conftest import API_KEY, MODEL, LiveServer
from tests.conftest import make_config, write_bpe_tokenizer, write_hf_checkpoint

ZEPHYR = ("{% for message in messages %}\n{% if message['role'] == 'user' %}\n"
          "{{ '<|user|>\n' + message['content'] + eos_token }}\n"
          "{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + "
          "eos_token }}\n{% elif message['role'] == 'assistant' %}\n"
          "{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n{% else %}\n"
          "{{ raise_exception('unknown role ' + message['role']) }}\n{% endif %}\n"
          "{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n"
          "{% endfor %}")
INDENTED = """{{ bos_token }}
{% for message in messages %}
    {% if message.role == 'system' %}
System: {{ message.content | trim }}
    {% else %}
{{ message.role | upper }}: {{ message.content | tojson }}
    {% endif %}
    {% if loop.index > 5 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
ASSISTANT:{% generation %} {% endgeneration %}
{% endif %}"""
CHAT_MODEL = "opt-chat"
TEMPLATES = {"zephyr": ZEPHYR, "indented": INDENTED, **CHAT_TEMPLATES}
MESSAGES = [{"role": "system", "content": "You are terse. "},
            {"role": "user", "content": "héllo wörld, 你好 \"quoted\""},
            {"role": "assistant", "content": "the quick brown fox"},
            {"role": "user", "content": "hello again"}]
CORPUS = ["hello world, this is a tiny corpus", "héllo wörld 你好 世界 🙂 emoji text",
          "the quick brown fox jumps over the lazy dog", "<|user|> <|assistant|> USER SYSTEM"]


def write_tokenizer(directory: Path, chat_template: str | None) -> Path:
    """A byte-level BPE as a Hub checkpoint lays it out: tokenizer.json and a
    tokenizer_config.json with OPT's special tokens (and the chat template, if any)."""
    write_bpe_tokenizer(directory, CORPUS)
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "</s>",
        "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": False,
                      "normalized": True, "rstrip": False, "single_word": False},
        "unk_token": "<unk>",
        "pad_token": "<pad>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = write_hf_checkpoint(tmp_path_factory.mktemp("opt-chat"))
    return write_tokenizer(directory, ZEPHYR)


def tokenize(server: LiveServer, body: dict[str, object]) -> dict[str, object]:
    """POST /v1/tokenize; returns the JSON answer (fails the test on an error status)."""
    request = urllib.request.Request(
        f"{server.url}/v1/tokenize", data=json.dumps(body).encode(), method="POST",
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


def serve(model: str, chat_template: str | None = None, name: str | None = None) -> LiveServer:
    server = LiveServer(make_config(model), ServerConfig(
        port=0, api_key=API_KEY, chat_template=chat_template, served_model_name=name))
    server.start()
    return server


@pytest.fixture(scope="module")
def chat_server(chat_checkpoint: Path) -> Iterator[LiveServer]:
    server = serve(str(chat_checkpoint), name=CHAT_MODEL)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(chat_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{chat_server.url}/v1", api_key=API_KEY, max_retries=0,
                       timeout=60) as c:
        yield c


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_template_renders_as_transformers(name: str, add_generation_prompt: bool,
                                          tmp_path: Path) -> None:
    hf = PreTrainedTokenizerFast.from_pretrained(write_tokenizer(tmp_path, TEMPLATES[name]))
    expected = hf.apply_chat_template(MESSAGES, tokenize=False,
                                      add_generation_prompt=add_generation_prompt)
    ours = ChatTemplate(TEMPLATES[name]).render(
        [ChatMessage(**m) for m in MESSAGES], add_generation_prompt)  # type: ignore[arg-type]
    assert ours == expected


def test_served_prompt_ids_equal_transformers(chat_server: LiveServer,
                                              chat_checkpoint: Path) -> None:
    hf = PreTrainedTokenizerFast.from_pretrained(chat_checkpoint)
    expected = hf.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True,
                                      return_dict=True)["input_ids"]
    assert tokenize(chat_server, {"messages": MESSAGES})["tokens"] == expected


def test_chat_answer_is_the_completion_of_the_rendered_prompt(
        client: openai.OpenAI, chat_server: LiveServer) -> None:
    ids = tokenize(chat_server, {"messages": MESSAGES})
    chat = client.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES,  # type: ignore[arg-type]
                                          max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
    completion = client.completions.create(model=CHAT_MODEL, prompt=ids["tokens"],
                                           max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    message = chat.choices[0].message
    assert message.role == "assistant" and message.content == completion.choices[0].text
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.prompt_tokens == ids["count"]


def test_streamed_chat_concatenates_to_the_whole_answer(client: openai.OpenAI,
                                                        chat_server: LiveServer) -> None:
    params = dict(model=CHAT_MODEL, messages=MESSAGES, max_tokens=16,
                  temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**params)  # type: ignore[call-overload]
    chunks = list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **params))  # type: ignore[call-overload]
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16


def test_chat_n_returns_indexed_choices(client: openai.OpenAI, chat_server: LiveServer) -> None:
    chat = client.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES,  # type: ignore[arg-type]
                                          n=3, max_tokens=4, seed=1)
    assert [c.index for c in chat.choices] == [0, 1, 2]


def test_unsupported_chat_field_is_a_400_naming_it(client: openai.OpenAI,
                                                   chat_server: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES,  # type: ignore[arg-type]
                                       tools=[{"type": "function",
                                               "function": {"name": "f", "parameters": {}}}])
    assert "tools" in str(info.value)


@pytest.mark.parametrize("chat_template", [None, "chatml"])
def test_base_model_needs_a_template(chat_template: str | None) -> None:
    server = serve(MODEL, chat_template)
    try:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as c:
            if chat_template is None:
                with pytest.raises(openai.BadRequestError) as info:
                    c.chat.completions.create(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]
                assert "--chat-template" in str(info.value)
            else:
                out = c.chat.completions.create(model=MODEL, messages=MESSAGES,  # type: ignore[arg-type]
                                                max_tokens=3)
                assert out.choices[0].message.role == "assistant"
    finally:
        server.stop()
