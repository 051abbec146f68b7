"""OPT model tests: logits and greedy ids against HF `transformers.OPTForCausalLM` on the
same weights (pre-LN and OPT-350m-style post-LN with projections), chunked and mixed batches.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

import models.opt
from models.attention import AttentionMetadata, get_backend
from models.loader import build_preset, load_checkpoint
from models.opt import PRESETS, Float32Linear, OPTConfig, fit_matmuls_to
from tests.models.conftest import PagedRunner, random_prompts, rel_err

HFCheckpoint = tuple[transformers.OPTForCausalLM, Path]


def hf_logits(hf: transformers.OPTForCausalLM, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # [len(ids), vocab]


def test_packed_prefill_logits_match_hf(hf_checkpoint: HFCheckpoint) -> None:
    hf, path = hf_checkpoint
    model, _ = load_checkpoint(path, torch.float32, "cpu")
    prompts = random_prompts([1, 7, 13, 30, 4], hf.config.vocab_size)
    runner = PagedRunner(model, [len(p) for p in prompts])
    logits = runner.step(dict(enumerate(prompts)))
    for ids, ours in zip(prompts, logits):
        assert rel_err(ours, hf_logits(hf, ids)) < 1e-5


@pytest.mark.parametrize("backend", ["paged", "padded"])
def test_decode_steps_match_hf_full_forward(hf_checkpoint: HFCheckpoint, backend: str) -> None:
    hf, path = hf_checkpoint
    model, _ = load_checkpoint(path, torch.float32, "cpu")
    prompts = random_prompts([5, 1, 17], hf.config.vocab_size, seed=1)
    extra = random_prompts([32] * 3, hf.config.vocab_size, seed=2)
    runner = PagedRunner(model, [len(p) + 32 for p in prompts], backend)
    runner.step(dict(enumerate(prompts)))
    decoded = [runner.step({i: [e[t]] for i, e in enumerate(extra)}) for t in range(32)]
    for i, (prompt, e) in enumerate(zip(prompts, extra)):
        ref = hf_logits(hf, prompt + e)[len(prompt):]  # [32, vocab]
        ours = torch.cat([step[i] for step in decoded])  # [32, vocab]
        assert rel_err(ours, ref) < 1e-5


def test_greedy_ids_match_hf_generate(hf_checkpoint: HFCheckpoint) -> None:
    hf, path = hf_checkpoint
    hf = hf.double()
    hf.generation_config.eos_token_id = None  # both sides ignore EOS for 32 tokens
    model, _ = load_checkpoint(path, torch.float64, "cpu")
    prompts = random_prompts([3, 9, 1, 14, 6, 20, 2, 11], hf.config.vocab_size, seed=3)
    ours = PagedRunner(model, [len(p) + 32 for p in prompts]).greedy(prompts, 32)
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32,
                              min_new_tokens=32, pad_token_id=1)
        assert got == ref[0, len(prompt):].tolist()


def test_chunked_prefill_equals_full_prefill() -> None:
    model, cfg = build_preset("opt-tiny", torch.float64, "cpu", seed=5)
    prompt = random_prompts([37], cfg.vocab_size)[0]
    full = PagedRunner(model, [37]).step({0: prompt})[0]
    chunked = PagedRunner(model, [37])
    parts = [chunked.step({0: prompt[a:b]})[0] for a, b in ((0, 16), (16, 32), (32, 37))]
    assert rel_err(torch.cat(parts), full) < 1e-12


def test_mixed_batch_equals_separate_forwards() -> None:
    model, cfg = build_preset("opt-tiny", torch.float64, "cpu", seed=6)
    a, b, c = random_prompts([9, 12, 6], cfg.vocab_size, seed=7)
    mixed, alone = PagedRunner(model, [10, 12, 6]), PagedRunner(model, [10, 12, 6])
    for runner in (mixed, alone):
        runner.step({0: a, 2: c[:4]})
    got = mixed.step({0: [5], 1: b, 2: c[4:]})  # decode + fresh prefill + chunk
    want = [alone.step({0: [5]})[0], alone.step({1: b})[0], alone.step({2: c[4:]})[0]]
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-12


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_decode_tracks_float32(dtype: torch.dtype) -> None:
    model32, cfg = build_preset("opt-tiny", torch.float32, "cpu", seed=8)
    model_lp, _ = build_preset("opt-tiny", dtype, "cpu", seed=8)
    prompts = random_prompts([30, 70], cfg.vocab_size)
    logits = []
    for model in (model32, model_lp):
        runner = PagedRunner(model, [71, 71])
        runner.step(dict(enumerate(prompts)))
        logits.append(torch.cat(runner.step({0: [7], 1: [9]})))
    assert rel_err(logits[1], logits[0]) < 5e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_matmuls_compute_what_half_precision_does(dtype: torch.dtype) -> None:
    native, cfg = build_preset("opt-tiny", dtype, "cpu", seed=8)
    upcast, _ = build_preset("opt-tiny", dtype, "cpu", seed=8)
    upcast.use_float32_matmuls()
    model32, _ = build_preset("opt-tiny", torch.float32, "cpu", seed=8)
    prompts = random_prompts([30, 70], cfg.vocab_size)
    logits = []
    for model in (native, upcast, model32):
        runner = PagedRunner(model, [71, 71])
        runner.step(dict(enumerate(prompts)))
        logits.append(torch.cat(runner.step({0: [7], 1: [9]})))
    assert rel_err(logits[1], logits[0]) < 2e-2  # summation order and rounding only
    # float32 activations between the matmuls: closer to float32 than half precision is
    assert rel_err(logits[1], logits[2]) < rel_err(logits[0], logits[2])
    assert isinstance(upcast.model.decoder.layers[0].fc1, Float32Linear)
    norm, native_norm = (m.model.decoder.layers[0].final_layer_norm for m in (upcast, native))
    assert norm.weight.dtype == torch.float32 and torch.equal(norm.weight, native_norm.weight)
    assert upcast.model.decoder.embed_tokens.weight.dtype == dtype


@pytest.mark.parametrize("c_gemm", [True, False])
def test_prepacked_float32_matmuls_match_hf(hf_checkpoint: HFCheckpoint,
                                            monkeypatch: pytest.MonkeyPatch,
                                            c_gemm: bool) -> None:
    hf, path = hf_checkpoint
    model, _ = load_checkpoint(path, torch.float32, "cpu")
    monkeypatch.setattr(models.opt, "PACK_MIN_WEIGHTS", 0)  # pack the tiny weights too
    if not c_gemm:
        monkeypatch.setattr(models.opt.cpu_gemm, "is_available", lambda: False)
    assert fit_matmuls_to(model, torch.device("cpu"))
    want = ("gemm" if c_gemm and models.opt.cpu_gemm.is_available() else
            "onednn" if torch.backends.mkldnn.is_available() else "torch")
    assert model.model.decoder.layers[0].fc1.kernel == want
    prompts = random_prompts([1, 7, 13, 30, 4], hf.config.vocab_size, seed=4)
    logits = PagedRunner(model, [len(p) for p in prompts]).step(dict(enumerate(prompts)))
    for ids, ours in zip(prompts, logits):
        assert rel_err(ours, hf_logits(hf, ids)) < 1e-5
    assert sum(p.numel() for p in model.parameters()) == hf.num_parameters()


def test_sequence_beyond_position_limit_raises() -> None:
    model, _ = build_preset("opt-tiny", torch.float32, "cpu", max_position_embeddings=8)
    meta = AttentionMetadata.build([9], [9], [[1, 2, 3]], 4, "cpu")
    kv_cache = torch.zeros(4, 2, 2, 4, 4, 16)
    with pytest.raises(ValueError, match=r"sequence length 9 exceeds max_position_embeddings \(8"):
        model(torch.zeros(9, dtype=torch.long), torch.arange(9), kv_cache, meta,
              get_backend("paged"))


def test_presets_have_real_opt_geometry() -> None:
    small = OPTConfig.from_name("opt-350m")
    assert (small.hidden_size, small.word_embed_proj_dim, small.do_layer_norm_before) == (
        1024, 512, False)
    big = OPTConfig.from_name("opt-30b", max_position_embeddings=10240)
    assert (big.num_layers, big.num_heads, big.head_dim, big.ffn_dim) == (48, 56, 128, 28672)
    assert big.max_position_embeddings == 10240
    assert OPTConfig.from_name("opt-tiny").max_position_embeddings >= 2048
    assert {"opt-125m", "opt-1.3b", "opt-2.7b", "opt-6.7b", "opt-13b"} <= set(PRESETS)


def test_unknown_preset_lists_presets() -> None:
    with pytest.raises(ValueError, match="opt-gigantic.*opt-125m"):
        OPTConfig.from_name("opt-gigantic")


def test_hf_config_maps_fields(hf_checkpoint: HFCheckpoint) -> None:
    hf, _ = hf_checkpoint
    cfg = OPTConfig.from_hf_config(hf.config.to_dict())
    assert cfg.num_layers == hf.config.num_hidden_layers == 2
    assert cfg.word_embed_proj_dim == hf.config.word_embed_proj_dim
    assert cfg.do_layer_norm_before == hf.config.do_layer_norm_before
    assert cfg.has_final_layer_norm == hf.config.do_layer_norm_before


@pytest.mark.parametrize(("change", "message"), [
    ({"model_type": "gpt2"}, "model_type 'gpt2'"),
    ({"activation_function": "gelu"}, "activation_function='gelu' is unsupported"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings=False is unsupported"),
    ({"num_attention_heads": 5}, r"hidden_size \(32\) must be a multiple of num_heads \(5\)"),
])
def test_hf_config_rejects_unsupported(hf_checkpoint: HFCheckpoint, change: dict[str, object],
                                       message: str) -> None:
    hf, _ = hf_checkpoint
    with pytest.raises(ValueError, match=message):
        OPTConfig.from_hf_config({**hf.config.to_dict(), **change})
