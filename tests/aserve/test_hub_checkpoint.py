"""A checkpoint laid out as the Hub ships facebook/opt-* (see tests/hub_checkpoint.py), served
over HTTP and read with the official `openai` client: greedy text equals `transformers`'
greedy text on the same directory, whole and streamed, for both weight formats."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
import transformers

from tests.aserve.conftest import openai_client
from tests.conftest import make_config
from tests.hub_checkpoint import write_hub_checkpoint

PROMPTS = ["Hello, my name is", "The weather today", "  Leading spaces, 世界 🙂",
           "Once upon a time</s> there"]
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=["bin", "safetensors"])
def hub_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hub_checkpoint(tmp_path_factory.mktemp(f"hub-{request.param}"), request.param)


@pytest.fixture(scope="module")
def client(hub_dir: Path) -> Iterator[openai.OpenAI]:
    with openai_client(make_config(str(hub_dir))) as c:
        yield c


@pytest.fixture(scope="module")
def expected(hub_dir: Path) -> dict[str, str]:
    """transformers' greedy completion of each prompt, on the same directory."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(hub_dir))
    model = transformers.OPTForCausalLM.from_pretrained(str(hub_dir)).eval()
    texts = {}
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        texts[prompt] = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    return texts


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_text_equals_transformers(prompt: str, client: openai.OpenAI,
                                         expected: dict[str, str]) -> None:
    out = client.completions.create(model=client.models.list().data[0].id, prompt=prompt,
                                    max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].text == expected[prompt]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_streamed_chunks_concatenate_to_transformers_text(
        prompt: str, client: openai.OpenAI, expected: dict[str, str]) -> None:
    chunks = client.completions.create(model=client.models.list().data[0].id, prompt=prompt,
                                       max_tokens=MAX_TOKENS, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == expected[prompt]


def test_prompt_tokens_are_counted_as_transformers_counts_them(
        hub_dir: Path, client: openai.OpenAI) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(hub_dir))
    out = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPTS[2],
                                    max_tokens=1, temperature=0)
    assert out.usage is not None
    assert out.usage.prompt_tokens == len(tokenizer(PROMPTS[2])["input_ids"])
