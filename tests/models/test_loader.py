"""Loader tests: every checkpoint layout HF writes, refusal of unsafe or broken checkpoints,
and seeded presets."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import safetensors.torch
import torch

from models.loader import build_preset, load_checkpoint, load_model
from tests.models.conftest import PagedRunner, make_hf_model, random_prompts, rel_err


@pytest.fixture(scope="module")
def hf_pre_ln() -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in make_hf_model("pre_ln").state_dict().items()}


def write_config(path: Path, **change: object) -> None:
    path.mkdir(parents=True, exist_ok=True)
    make_hf_model("pre_ln").config.to_json_file(path / "config.json")
    if change:
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **change}))


def save_bin_shards(state: dict[str, torch.Tensor], path: Path, num_shards: int) -> None:
    names = sorted(state)
    weight_map = {}
    for shard in range(num_shards):
        file = f"pytorch_model-{shard + 1:05d}-of-{num_shards:05d}.bin"
        part = {n: state[n] for n in names[shard::num_shards]}
        torch.save(part, path / file)
        weight_map.update(dict.fromkeys(part, file))
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))


def prefill_logits(path: Path) -> torch.Tensor:
    model, cfg = load_checkpoint(path, torch.float32, "cpu")
    prompt = random_prompts([11], cfg.vocab_size)[0]
    return PagedRunner(model, [11]).step({0: prompt})[0]


@pytest.mark.parametrize("layout", ["sharded_safetensors", "bin", "sharded_bin", "old_prefix",
                                    "hub_bin", "hub_sharded_bin"])
def test_every_layout_loads_the_same_model(tmp_path: Path, layout: str,
                                           hf_pre_ln: dict[str, torch.Tensor]) -> None:
    single, other = tmp_path / "single", tmp_path / "other"
    make_hf_model("pre_ln").save_pretrained(single)
    write_config(other)
    if layout == "sharded_safetensors":
        make_hf_model("pre_ln").save_pretrained(other, max_shard_size="20KB")
        assert (other / "model.safetensors.index.json").is_file()
    elif layout == "bin":
        torch.save(hf_pre_ln, other / "pytorch_model.bin")
    elif layout == "sharded_bin":
        save_bin_shards(hf_pre_ln, other, 3)
    elif layout.startswith("hub_"):  # facebook/opt-*'s pytorch_model.bin: OPTModel's keys
        hub = {k.removeprefix("model."): v for k, v in hf_pre_ln.items() if k != "lm_head.weight"}
        if layout == "hub_bin":
            torch.save(hub, other / "pytorch_model.bin")
        else:
            save_bin_shards(hub, other, 2)
    else:  # facebook/opt-* files name the base model's tensors `decoder.*`, no LM head
        old = {k.removeprefix("model."): v for k, v in hf_pre_ln.items() if k != "lm_head.weight"}
        safetensors.torch.save_file(old, other / "model.safetensors")
    assert rel_err(prefill_logits(other), prefill_logits(single)) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp16_checkpoint_loads_into_another_dtype(tmp_path: Path, dtype: torch.dtype) -> None:
    hf = make_hf_model("pre_ln").half()
    hf.save_pretrained(tmp_path)
    model, _ = load_checkpoint(tmp_path, dtype, "cpu")
    ours = model.model.decoder.layers[0].fc1.weight
    assert ours.dtype == dtype
    assert torch.equal(ours, hf.model.decoder.layers[0].fc1.weight.to(dtype))


def test_eos_comes_from_generation_config_then_config(tmp_path: Path) -> None:
    make_hf_model("pre_ln").save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7]}))
    assert load_checkpoint(tmp_path, torch.float32, "cpu").config.eos_token_id == 7
    (tmp_path / "generation_config.json").unlink()
    write_config(tmp_path, eos_token_id=5)
    assert load_checkpoint(tmp_path, torch.float32, "cpu").config.eos_token_id == 5
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    with pytest.raises(ValueError, match=r"eos_token_id lists several ids \(\[7, 8\]\)"):
        load_checkpoint(tmp_path, torch.float32, "cpu")


def test_malicious_pickle_is_refused(tmp_path: Path) -> None:
    class Exploit:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return os.system, (f"touch {tmp_path / 'pwned'}",)

    write_config(tmp_path)
    torch.save({"model.decoder.embed_tokens.weight": Exploit()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="refusing .*pytorch_model.bin: not a plain weights"):
        load_checkpoint(tmp_path, torch.float32, "cpu")
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize(("edit", "message"), [
    ("drop", r"lacks 1 tensors, e.g. \['model.decoder.layers.1.fc2.bias'\]"),
    ("extra", r"tensor 'model.decoder.extra.weight' is unexpected"),
    ("reshape", r"'model.decoder.layers.0.fc1.weight' has shape \(64, 31\), expected \(64, 32\)"),
])
def test_broken_tensors_are_named(tmp_path: Path, hf_pre_ln: dict[str, torch.Tensor], edit: str,
                                  message: str) -> None:
    state = dict(hf_pre_ln)
    if edit == "drop":
        del state["model.decoder.layers.1.fc2.bias"]
    elif edit == "extra":
        state["model.decoder.extra.weight"] = torch.zeros(2)
    else:
        state["model.decoder.layers.0.fc1.weight"] = torch.zeros(64, 31)
    write_config(tmp_path)
    safetensors.torch.save_file({k: v.contiguous() for k, v in state.items()},
                                tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=message):
        load_checkpoint(tmp_path, torch.float32, "cpu")


def test_bad_directories_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"checkpoint directory {tmp_path / 'nope'} does not"):
        load_checkpoint(tmp_path / "nope", torch.float32, "cpu")
    with pytest.raises(ValueError, match="has no config.json"):
        load_checkpoint(tmp_path, torch.float32, "cpu")
    write_config(tmp_path, model_type="llama")
    with pytest.raises(ValueError, match="model_type 'llama' is not 'opt'"):
        load_checkpoint(tmp_path, torch.float32, "cpu")
    write_config(tmp_path)
    with pytest.raises(ValueError, match="has no model.safetensors or pytorch_model.bin"):
        load_checkpoint(tmp_path, torch.float32, "cpu")


def test_load_model_takes_a_path_and_keeps_its_position_limit(tmp_path: Path) -> None:
    make_hf_model("post_ln").save_pretrained(tmp_path)
    model, cfg = load_model(str(tmp_path), "bfloat16", "cpu")
    assert cfg.word_embed_proj_dim == 16 and not cfg.do_layer_norm_before
    assert model.model.decoder.layers[0].fc1.weight.dtype == torch.bfloat16
    assert not any(p.requires_grad for p in model.parameters())
    with pytest.raises(ValueError, match=r"max_position_embeddings \(4096\) exceeds .*\(160\)"):
        load_model(str(tmp_path), "float32", "cpu", max_position_embeddings=4096)


def test_load_model_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="dtype 'float8'.*float32, float16, bfloat16, float64"):
        load_model("opt-tiny", "float8", "cpu")
    with pytest.raises(ValueError, match="'opt-9b' is neither a preset .*opt-125m"):
        load_model("opt-9b", "float32", "cpu")


def test_preset_weights_depend_only_on_seed() -> None:
    a, cfg = load_model("opt-tiny", torch.float32, "cpu", seed=3)
    b, _ = build_preset("opt-tiny", torch.float32, "cpu", seed=3)
    c, _ = build_preset("opt-tiny", torch.float32, "cpu", seed=4)
    for (name, x), y, z in zip(a.state_dict().items(), b.state_dict().values(),
                               c.state_dict().values()):
        assert torch.equal(x, y), name
        if "layer_norm" not in name and not name.endswith("bias"):
            assert not torch.equal(x, z), name
            assert 0.015 < float(x.std()) < 0.025, name
    norm = a.model.decoder.layers[1].final_layer_norm
    assert torch.equal(norm.weight, torch.ones(cfg.hidden_size))
    assert torch.equal(norm.bias, torch.zeros(cfg.hidden_size))


def test_preset_extends_position_table() -> None:
    model, cfg = build_preset("opt-tiny", torch.bfloat16, "cpu", max_position_embeddings=10240)
    assert cfg.max_position_embeddings == 10240
    assert model.model.decoder.embed_positions.weight.shape == (10242, cfg.hidden_size)
    assert model.model.decoder.embed_positions.weight.dtype == torch.bfloat16
