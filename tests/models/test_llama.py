"""The Llama family (Llama, Qwen2, Mistral) against transformers: random-weight geometries
saved as HF directories give the same greedy tokens in float64, across GQA ratios, MQA,
rotary scalings, tied and untied embeddings and attention biases; the KV cache holds the
KV heads only."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
import transformers

from aserve import Engine
from models.llama import PRESETS, LlamaConfig, LlamaForCausalLM
from models.loader import load_model
from tests.conftest import make_config, make_prompts
from tests.models.conftest import PagedRunner

NUM_TOKENS = 12
BASE = dict(vocab_size=256, num_hidden_layers=2, intermediate_size=96,
            max_position_embeddings=512, rms_norm_eps=1e-6)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
GEOMETRIES = {  # id -> (transformers config class, config fields)
    "llama-gqa1-untied": (transformers.LlamaConfig, dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
        tie_word_embeddings=False)),
    "llama-gqa3-llama3-tied": (transformers.LlamaConfig, dict(
        hidden_size=96, num_attention_heads=6, num_key_value_heads=2, rope_scaling=LLAMA3,
        rope_theta=500000.0, tie_word_embeddings=True)),
    "qwen2-gqa4-bias-tied": (transformers.Qwen2Config, dict(
        hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
        tie_word_embeddings=True, rope_theta=1000000.0)),
    "mistral-gqa8-untied": (transformers.MistralConfig, dict(
        hidden_size=128, num_attention_heads=16, num_key_value_heads=2, sliding_window=None,
        tie_word_embeddings=False)),
    "llama-mqa-bias-linear": (transformers.LlamaConfig, dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=1, attention_bias=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=False)),
}


def hf_model(tmp_path: Path, name: str) -> tuple[Path, transformers.PreTrainedModel]:
    config_class, fields = GEOMETRIES[name]
    config = config_class(**BASE, **fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float64)
    with torch.no_grad():  # biases and norms away from their init, so that they count
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias") or "norm" in param_name:
                param.add_(torch.randn_like(param) * 0.1)
    model.eval().save_pretrained(tmp_path)
    return tmp_path, model


def hf_greedy(model: transformers.PreTrainedModel, prompts: list[list[int]], n: int
              ) -> list[list[int]]:
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(prompt):].tolist())
    return outs


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_greedy_ids_match_transformers_in_float64(tmp_path: Path, name: str) -> None:
    directory, reference = hf_model(tmp_path, name)
    loaded = load_model(str(directory), "float64", "cpu")
    assert isinstance(loaded.model, LlamaForCausalLM)
    config = reference.config
    assert loaded.config.num_kv_heads == config.num_key_value_heads
    assert loaded.config.tie_word_embeddings == config.tie_word_embeddings
    prompts = make_prompts(4, 3, 90, 256, seed=1)
    expected = hf_greedy(reference, prompts, NUM_TOKENS)
    for backend in ("paged", "padded"):
        runner = PagedRunner(loaded.model, [len(p) + NUM_TOKENS for p in prompts], backend)
        assert runner.greedy(prompts, NUM_TOKENS) == expected, backend


def test_prefill_logits_match_transformers(tmp_path: Path) -> None:
    directory, reference = hf_model(tmp_path, "llama-gqa3-llama3-tied")
    ours = load_model(str(directory), "float64", "cpu").model
    prompt = make_prompts(1, 100, 100, 256, seed=5)[0]
    with torch.inference_mode():
        expected = reference(torch.tensor([prompt])).logits[0]
    got = PagedRunner(ours, [len(prompt)]).step({0: prompt})[0]
    assert torch.allclose(got, expected, rtol=0, atol=1e-10)


def test_float32_matmuls_track_float64(tmp_path: Path) -> None:
    directory, _ = hf_model(tmp_path, "qwen2-gqa4-bias-tied")
    exact = load_model(str(directory), "float64", "cpu").model
    fast = load_model(str(directory), "float32", "cpu").model
    fast.use_float32_matmuls()
    prompt = make_prompts(1, 40, 40, 256, seed=6)[0]
    want = PagedRunner(exact, [len(prompt)]).step({0: prompt})[0]
    got = PagedRunner(fast, [len(prompt)]).step({0: prompt})[0]
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max() < 1e-4


def test_sharded_safetensors_load(tmp_path: Path) -> None:
    directory, reference = hf_model(tmp_path, "llama-gqa1-untied")
    reference.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    whole = load_model(str(directory), "float64", "cpu").model.state_dict()
    sharded = load_model(str(tmp_path / "sharded"), "float64", "cpu").model.state_dict()
    assert all(torch.equal(whole[k], sharded[k]) for k in whole)


@pytest.mark.parametrize(("change", "message"), [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn'"),
    ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
    ({"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"}, "unsupported"),
])
def test_unsupported_configs_are_named(change: dict[str, object], message: str) -> None:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
              "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "intermediate_size": 96, **change}
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_hf_config(config)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    import safetensors.torch

    directory, _ = hf_model(tmp_path, "llama-gqa1-untied")
    tensors = safetensors.torch.load_file(str(directory / "model.safetensors"))
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    safetensors.torch.save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(ValueError, match="only some of the tensors of "
                                         "model.layers.1.self_attn.qkv_proj.weight"):
        load_model(str(directory), "float32", "cpu")


def test_kv_blocks_are_sized_from_the_kv_heads() -> None:
    """Per token: 2 x layers x kv_heads x head_dim x dtype bytes, not the query heads."""
    config = make_config("llama-tiny", block_size=16, num_decode_blocks=8, num_prefill_blocks=8,
                         num_staging_blocks=8)

    async def geometry() -> tuple[int, tuple[int, ...]]:
        async with Engine(config) as engine:
            kv = engine.ctx.kv
            return kv["decode0"].geometry.bytes_per_block, tuple(kv["decode0"].tensor.shape)

    cfg = LlamaConfig(**PRESETS["llama-tiny"])
    assert cfg.num_kv_heads < cfg.num_heads
    per_block, shape = asyncio.run(geometry())
    assert per_block == 16 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert shape[1:] == (cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim)
