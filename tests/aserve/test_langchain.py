"""LangChain's OpenAI wrappers (`langchain-openai`: the completions `OpenAI` and the
`ChatOpenAI` chat model) against a real server, with the bodies they really send: answers
equal the official `openai` client's, streamed and not."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI, OpenAI

from tests.aserve.conftest import API_KEY, MODEL, LiveServer
from tests.aserve.test_chat import CHAT_MODEL, chat_checkpoint, chat_server  # noqa: F401

SEEDED = dict(temperature=1.0, seed=11, max_tokens=12, max_retries=0, api_key=API_KEY)
MESSAGES = [SystemMessage("You are terse."), HumanMessage("héllo wörld"),
            AIMessage("the quick brown fox"), HumanMessage("hello again")]
OPENAI_MESSAGES = [{"role": "system", "content": "You are terse."},
                   {"role": "user", "content": "héllo wörld"},
                   {"role": "assistant", "content": "the quick brown fox"},
                   {"role": "user", "content": "hello again"}]


@pytest.fixture(scope="module")
def client(chat_server: LiveServer) -> Iterator[openai.OpenAI]:  # noqa: F811
    with openai.OpenAI(base_url=f"{chat_server.url}/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


def test_openai_llm_equals_the_openai_client(live_server: LiveServer) -> None:
    llm = OpenAI(base_url=f"{live_server.url}/v1", model=MODEL, **SEEDED)  # type: ignore[arg-type]
    with openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=API_KEY) as c:
        expected = c.completions.create(model=MODEL, prompt="Once upon a time", temperature=1.0,
                                        seed=11, max_tokens=12).choices[0].text
    assert llm.invoke("Once upon a time") == expected
    assert "".join(llm.stream("Once upon a time")) == expected


def test_openai_llm_n_and_penalties(live_server: LiveServer) -> None:
    llm = OpenAI(base_url=f"{live_server.url}/v1", model=MODEL, n=3, presence_penalty=0.5,
                 frequency_penalty=0.5, **SEEDED)  # type: ignore[arg-type]
    result = llm.generate(["Once upon a time"])
    assert len(result.generations[0]) == 3


def test_chat_openai_equals_the_openai_client(chat_server: LiveServer,  # noqa: F811
                                              client: openai.OpenAI) -> None:
    chat = ChatOpenAI(base_url=f"{chat_server.url}/v1", model=CHAT_MODEL, **SEEDED)  # type: ignore[arg-type]
    expected = client.chat.completions.create(
        model=CHAT_MODEL, messages=OPENAI_MESSAGES, temperature=1.0, seed=11,  # type: ignore[arg-type]
        max_tokens=12).choices[0].message.content
    answer = chat.invoke(MESSAGES)
    assert isinstance(answer, AIMessage) and answer.content == expected
    assert "".join(str(chunk.content) for chunk in chat.stream(MESSAGES)) == expected
