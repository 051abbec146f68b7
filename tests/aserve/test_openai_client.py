"""The official `openai` client against a real server on an ephemeral port: completions,
streaming, token-id prompts, batches, stop strings, logprobs and usage."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.aserve.conftest import API_KEY, MODEL, LiveServer

NO_EOS = {"ignore_eos": True}  # vLLM-style extra field: fixed output lengths


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=API_KEY, max_retries=0,
                       timeout=60) as c:
        yield c


def complete(client: openai.OpenAI, prompt: object, **kwargs: object) -> openai.types.Completion:
    kwargs.setdefault("extra_body", NO_EOS)
    return client.completions.create(model=MODEL, prompt=prompt, **kwargs)  # type: ignore


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_completion_returns_text_and_usage(client: openai.OpenAI) -> None:
    out = complete(client, "Hello, my name is", max_tokens=12, temperature=0)
    choice = out.choices[0]
    assert out.object == "text_completion" and out.model == MODEL
    assert choice.finish_reason == "length" and choice.index == 0 and choice.text
    assert out.usage is not None
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_streamed_chunks_concatenate_to_the_completion(client: openai.OpenAI) -> None:
    params = dict(max_tokens=24, temperature=1.0, top_p=0.9, seed=1234)
    whole = complete(client, "The weather today", **params)
    chunks = list(complete(client, "The weather today", stream=True, **params))
    assert len(chunks) > 1
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_stream_include_usage_sends_a_last_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(complete(client, "Count:", max_tokens=5, temperature=0, stream=True,
                           stream_options={"include_usage": True}))
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])


def test_token_id_prompt_counts_its_tokens(client: openai.OpenAI) -> None:
    prompt = [2, 100, 101, 102, 103, 104, 105]
    out = complete(client, prompt, max_tokens=4, temperature=0)
    assert out.usage is not None and out.usage.prompt_tokens == len(prompt)
    assert out.usage.completion_tokens == 4


def test_batch_of_prompts_matches_single_requests(client: openai.OpenAI) -> None:
    prompts = ["first prompt", [2, 50, 60, 70], "a third, longer prompt than the others"]
    batch = complete(client, prompts, max_tokens=8, temperature=0.8, seed=7)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2]
    for choice in batch.choices:
        single = complete(client, prompts[choice.index], max_tokens=8, temperature=0.8, seed=7)
        assert choice.text == single.choices[0].text
    assert batch.usage is not None and batch.usage.completion_tokens == 3 * 8


def test_stop_string_ends_the_completion_before_it(client: openai.OpenAI) -> None:
    sampling = dict(max_tokens=24, temperature=1.0, seed=3)  # random weights: greedy is
    text = complete(client, "Stop here:", **sampling).choices[0].text  # often non-ASCII
    stop = next((ch for ch in text[3:] if ch.isprintable() and ch != "\ufffd"), None)
    assert stop is not None, f"no usable stop character in {text!r}"
    out = complete(client, "Stop here:", stop=[stop, "\x00zz"], **sampling)
    assert out.choices[0].text == text[:text.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_logprobs_cover_every_generated_token(client: openai.OpenAI) -> None:
    out = complete(client, "Log probabilities", max_tokens=6, temperature=0, logprobs=1)
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert len(logprobs.token_logprobs) == 6 and len(logprobs.tokens or []) == 6
    assert all(lp <= 0.0 for lp in logprobs.token_logprobs)
    offsets = logprobs.text_offset or []
    assert offsets[0] == 0 and offsets == sorted(offsets)


def test_streamed_logprobs_equal_the_whole_ones(client: openai.OpenAI) -> None:
    kwargs = dict(max_tokens=6, temperature=0, logprobs=0)
    whole = complete(client, "Same logprobs", **kwargs).choices[0].logprobs
    chunks = list(complete(client, "Same logprobs", stream=True, **kwargs))
    streamed = [lp for c in chunks for lp in (c.choices[0].logprobs.token_logprobs or [])]
    assert whole is not None and streamed == whole.token_logprobs


def test_wrong_api_key_is_rejected(live_server: LiveServer) -> None:
    with openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="wrong",
                       max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=MODEL, prompt="hi", max_tokens=1)


def test_unknown_model_is_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="no-such-model"):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)


# Bodies a server could refuse or ignore, sent by the official client.
FIELDS = {
    "presence_penalty": dict(presence_penalty=0.5),
    "frequency_penalty": dict(frequency_penalty=0.5),
    "repetition_penalty": dict(extra_body={**NO_EOS, "repetition_penalty": 1.1}),
    "logit_bias": dict(logit_bias={"101": 100}),  # id 101 is the byte "a"
    "n": dict(n=2, seed=3, temperature=1.0),
    "best_of": dict(n=2, best_of=2, seed=3, temperature=1.0),
    "echo": dict(echo=True),
}


@pytest.mark.parametrize("fields", list(FIELDS.values()), ids=list(FIELDS))
def test_client_fields_are_honoured(client: openai.OpenAI, fields: dict[str, object]) -> None:
    out = complete(client, "Hello", max_tokens=6, **{"temperature": 0, **fields})
    assert len(out.choices) == fields.get("n", 1)
    assert [c.index for c in out.choices] == list(range(len(out.choices)))
    text = out.choices[0].text
    if "logit_bias" in fields:
        assert text == "a" * 6
    if "echo" in fields:
        assert text.startswith("Hello") and len(text) > len("Hello")
    if "n" in fields:  # seeded samples are reproducible
        again = complete(client, "Hello", max_tokens=6, **{"temperature": 0, **fields})
        assert [c.text for c in again.choices] == [c.text for c in out.choices]
