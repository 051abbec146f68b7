"""The vLLM-shaped offline API: `LLM(...).generate`, `EngineConfig`'s flat keywords with
vLLM's names, the two seeds, and the README's examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from aserve import LLM, EngineConfig, SamplingParams
from aserve.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from tests.hub_checkpoint import write_hub_checkpoint

README = Path(__file__).resolve().parents[2] / "README.md"
SMALL = dict(num_decode_blocks=256, num_prefill_blocks=256, num_staging_blocks=256,
             host_pool_gb=0.05)  # opt-tiny needs little KV memory


def test_flat_keywords_build_the_same_config_as_create() -> None:
    flat = EngineConfig(model="opt-tiny", dtype="bfloat16", policy="fcfs", block_size=8)
    assert flat == EngineConfig.create(model="opt-tiny", dtype="bfloat16", policy="fcfs",
                                       block_size=8)
    assert (flat.model.model, flat.model.dtype, flat.scheduler.policy,
            flat.cache.block_size) == ("opt-tiny", "bfloat16", "fcfs", 8)


def test_area_objects_still_work_and_flat_keywords_override_them() -> None:
    by_area = EngineConfig(model=ModelConfig(model="opt-tiny"), cache=CacheConfig(block_size=8),
                           scheduler=SchedulerConfig(policy="fcfs"), seed=3)
    assert (by_area.model.model, by_area.cache.block_size, by_area.seed) == ("opt-tiny", 8, 3)
    mixed = EngineConfig(model=ModelConfig(model="opt-tiny", dtype="bfloat16"), block_size=32)
    assert (mixed.model.dtype, mixed.cache.block_size) == ("bfloat16", 32)


def test_vllm_names_map_to_ours() -> None:
    config = EngineConfig(model="opt-tiny", max_num_seqs=7, max_num_batched_tokens=512,
                          max_model_len=1024, enforce_eager=True, seed=5, tokenizer="bytes")
    assert config.scheduler.max_batch_size == 7
    assert config.scheduler.max_prefill_tokens == 512
    assert config.model.max_position_embeddings == 1024
    assert config.model.cuda_graphs is False and config.model.tokenizer == "bytes"
    assert config.seed == 5 and config.model.weights_seed == 0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"gpu_memory_utilization": 0.9}, "unknown engine option 'gpu_memory_utilization'"),
    ({"dtype": "float8"}, r"dtype \('float8'\) must be one of"),
    ({"block_size": 0}, r"block_size \(0\) must be >= 1"),
])
def test_bad_keywords_are_named(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="opt-tiny", **kwargs)


def test_llm_generate_returns_outputs_in_prompt_order() -> None:
    with LLM(model="opt-tiny", policy="fcfs", dtype="float32", **SMALL) as llm:
        prompts = ["Hello, my name is", [2, 40, 41, 42], "A longer prompt than the others"]
        outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0,
                                                    ignore_eos=True))
        again = llm.generate(prompts[0], SamplingParams(max_tokens=5, temperature=0,
                                                        ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [5, 5, 5]
    assert outs[1].prompt_token_ids == [2, 40, 41, 42]
    assert again[0].token_ids == outs[0].token_ids  # the engine stayed loaded: same weights
    with pytest.raises(ValueError, match="closed"):
        llm.generate("again")


def _sampled(seed: int, weights_seed: int = 0) -> list[int]:
    with LLM(model="opt-tiny", dtype="float32", seed=seed, weights_seed=weights_seed,
             **SMALL) as llm:
        return llm.generate("Hello", SamplingParams(max_tokens=24, temperature=1.0,
                                                    ignore_eos=True))[0].token_ids


def test_seed_makes_unseeded_sampling_repeat_and_weights_seed_changes_weights() -> None:
    first = _sampled(seed=1)
    assert _sampled(seed=1) == first
    assert _sampled(seed=2) != first
    with LLM(model="opt-tiny", dtype="float32", weights_seed=1, **SMALL) as a, \
            LLM(model="opt-tiny", dtype="float32", weights_seed=2, **SMALL) as b:
        greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        assert a.generate("Hello", greedy)[0].token_ids != b.generate("Hello", greedy)[0].token_ids


def test_max_model_len_caps_a_checkpoint(tmp_path: Path) -> None:
    path = write_hub_checkpoint(tmp_path / "hub")
    with LLM(model=str(path), max_model_len=16, **SMALL) as llm:
        with pytest.raises(ValueError, match="16"):
            llm.generate("a prompt that is long enough " * 2, SamplingParams(max_tokens=8))
        assert llm.generate("Hi", SamplingParams(max_tokens=4))[0].text is not None


def test_tokenizer_from_another_directory(tmp_path: Path) -> None:
    path = write_hub_checkpoint(tmp_path / "hub")
    weights_only = tmp_path / "weights"
    weights_only.mkdir()
    for name in ("config.json", "pytorch_model.bin"):
        (weights_only / name).write_bytes((path / name).read_bytes())
    with pytest.raises(ValueError, match="has no tokenizer files"):
        LLM(model=str(weights_only), **SMALL)
    greedy = SamplingParams(max_tokens=6, temperature=0)
    with LLM(model=str(path), **SMALL) as own, \
            LLM(model=str(weights_only), tokenizer=str(path), **SMALL) as other:
        assert other.generate("Hello, my name is", greedy)[0].text == own.generate(
            "Hello, my name is", greedy)[0].text


def test_readme_examples_run() -> None:
    """Every ```python block that follows a `<!-- test: readme -->` line runs as written."""
    blocks = re.findall(r"<!-- test: readme -->\n```python\n(.*?)```", README.read_text(),
                        flags=re.S)
    assert len(blocks) >= 2, "README lost its tested examples"
    for block in blocks:
        exec(compile(block, str(README), "exec"), {})  # noqa: S102
