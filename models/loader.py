"""Builds an `OPTForCausalLM`: from a HF checkpoint directory, or from a preset with seeded
random weights. Validates everything it reads; never executes code from a pickle.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import NamedTuple

import safetensors.torch
import torch
from torch import Tensor

from models.opt import PRESETS, OPTConfig, OPTForCausalLM

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}
INIT_STD = 0.02  # std of the normal init of weights and embeddings, as HF's init_std
INIT_CHUNK = 1 << 24  # elements generated at a time by the preset init
QKV = ("q_proj", "k_proj", "v_proj")  # HF's separate projections, in fused-row order


class LoadedModel(NamedTuple):
    model: OPTForCausalLM
    config: OPTConfig


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A dtype by name or value; raises ValueError listing the supported ones."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype {dtype!r} is unsupported; valid: {', '.join(DTYPES)}")


def load_model(model: str, dtype: str | torch.dtype, device: torch.device | str, seed: int = 0,
               max_position_embeddings: int | None = None) -> LoadedModel:
    """A preset name (`PRESETS`, random weights from `seed`) or a checkpoint directory.

    A checkpoint keeps its own position limit: asking for a longer one raises ValueError.
    """
    torch_dtype = resolve_dtype(dtype)
    if model in PRESETS:
        return build_preset(model, torch_dtype, device, seed, max_position_embeddings)
    if not Path(model).is_dir():
        raise ValueError(f"model {model!r} is neither a preset ({', '.join(PRESETS)}) "
                         f"nor a checkpoint directory")
    loaded = load_checkpoint(model, torch_dtype, device)
    limit = loaded.config.max_position_embeddings
    if max_position_embeddings is not None and max_position_embeddings > limit:
        raise ValueError(f"max_position_embeddings ({max_position_embeddings}) exceeds the "
                         f"checkpoint's limit ({limit})")
    return loaded


def build_preset(name: str, dtype: torch.dtype, device: torch.device | str, seed: int = 0,
                 max_position_embeddings: int | None = None) -> LoadedModel:
    """Preset geometry with random weights: normal(0, 0.02), zero biases, LayerNorms 1/0.

    Values come from a CPU generator in `dtype`, chunk by chunk, so they are the same for a
    seed on any device and a big preset never needs a float32 copy of itself.
    """
    cfg = OPTConfig.from_name(name, max_position_embeddings)
    with torch.device("meta"):
        model = OPTForCausalLM(cfg).to(dtype)
    model.to_empty(device=device)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "layer_norm" in param_name:
                param.fill_(1.0 if param_name.endswith("weight") else 0.0)
            elif param_name.endswith("bias"):
                param.zero_()
            else:
                _fill_normal(param, generator)
    return LoadedModel(_finish(model), cfg)


def _fill_normal(param: Tensor, generator: torch.Generator) -> None:
    flat = param.view(-1)
    for start in range(0, flat.numel(), INIT_CHUNK):
        chunk = flat[start:start + INIT_CHUNK]
        if chunk.device.type == "cpu":
            chunk.normal_(0.0, INIT_STD, generator=generator)
        else:
            cpu = torch.empty(chunk.shape, dtype=chunk.dtype)
            chunk.copy_(cpu.normal_(0.0, INIT_STD, generator=generator))


def load_checkpoint(path: str | Path, dtype: torch.dtype, device: torch.device | str
                    ) -> LoadedModel:
    """Loads `config.json` plus safetensors or `pytorch_model*.bin` weights (sharded or not).

    Raises:
        ValueError: missing directory or config.json, a non-OPT config, a pickle that is not
            plain weights, or missing / unexpected / mis-shaped tensors (named).
    """
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"checkpoint directory {root} does not exist")
    config_file = root / "config.json"
    if not config_file.is_file():
        raise ValueError(f"checkpoint {root} has no config.json")
    cfg = OPTConfig.from_hf_config({**json.loads(config_file.read_text()),
                                    **_generation_tokens(root)})
    with torch.device("meta"):
        model = OPTForCausalLM(cfg)
    state = _to_state_dict(_read_weights(root), model)
    model.load_state_dict({name: t.to(device=device, dtype=dtype) for name, t in state.items()},
                          strict=True, assign=True)
    return LoadedModel(_finish(model), cfg)


def _generation_tokens(root: Path) -> dict[str, int]:
    """bos / eos ids from generation_config.json, which win over config.json's (as they do
    for transformers' `generate`)."""
    file = root / "generation_config.json"
    found: dict[str, int] = {}
    if not file.is_file():
        return found
    config = json.loads(file.read_text())
    for key in ("bos_token_id", "eos_token_id"):
        value = config.get(key)
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, list):
            raise ValueError(f"{file}: {key} lists several ids ({value}); one is supported")
        if isinstance(value, int):
            found[key] = value
    return found


def _finish(model: OPTForCausalLM) -> OPTForCausalLM:
    return model.eval().requires_grad_(False)


def _read_weights(root: Path) -> dict[str, Tensor]:
    """Every tensor of the checkpoint, by its name in the file."""
    for index_name, single_name, reader in (
        ("model.safetensors.index.json", "model.safetensors", _read_safetensors),
        ("pytorch_model.bin.index.json", "pytorch_model.bin", _read_pickle),
    ):
        index_file = root / index_name
        if index_file.is_file():
            weight_map = json.loads(index_file.read_text()).get("weight_map", {})
            files = sorted(set(weight_map.values()))
        elif (root / single_name).is_file():
            files = [single_name]
        else:
            continue
        tensors: dict[str, Tensor] = {}
        for file in files:
            tensors.update(reader(root / file))
        return tensors
    raise ValueError(f"checkpoint {root} has no model.safetensors or pytorch_model.bin "
                     f"(single or sharded with an index.json)")


def _read_safetensors(file: Path) -> dict[str, Tensor]:
    if not file.is_file():
        raise ValueError(f"weight shard {file} named by the index does not exist")
    return safetensors.torch.load_file(str(file), device="cpu")


def _read_pickle(file: Path) -> dict[str, Tensor]:
    if not file.is_file():
        raise ValueError(f"weight shard {file} named by the index does not exist")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(f"refusing {file}: not a plain weights pickle ({exc})") from exc
    if not isinstance(state, dict) or not all(isinstance(t, Tensor) for t in state.values()):
        raise ValueError(f"{file} does not hold a name -> tensor dict")
    return state


def _to_state_dict(tensors: dict[str, Tensor], model: OPTForCausalLM) -> dict[str, Tensor]:
    """Renames HF tensors to this model's names (fusing q/k/v), checking names and shapes."""
    expected = _expected_hf_shapes(model)
    found: dict[str, Tensor] = {}
    for name, tensor in tensors.items():
        key = "model." + name if name.startswith("decoder.") else name
        if key == "lm_head.weight":
            # NOTE: OPT ties the LM head to embed_tokens; a stored copy is checked, then dropped.
            expected[key] = expected["model.decoder.embed_tokens.weight"]
        if key not in expected:
            raise ValueError(f"checkpoint tensor {name!r} is unexpected for this OPT config")
        if tuple(tensor.shape) != expected[key]:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {expected[key]}")
        found[key] = tensor
    missing = sorted(set(expected) - set(found) - {"lm_head.weight"})
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    found.pop("lm_head.weight", None)
    return _fuse_qkv(found)


def _expected_hf_shapes(model: OPTForCausalLM) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for name, tensor in model.state_dict().items():
        if ".qkv_proj." in name:
            part = (tensor.shape[0] // 3, *tensor.shape[1:])
            for proj in QKV:
                shapes[name.replace("qkv_proj", proj)] = part
        else:
            shapes[name] = tuple(tensor.shape)
    return shapes


def _fuse_qkv(state: dict[str, Tensor]) -> dict[str, Tensor]:
    fused: dict[str, Tensor] = {}
    for name, tensor in state.items():
        if ".q_proj." in name:
            parts = [state[name.replace("q_proj", proj)] for proj in QKV]
            fused[name.replace("q_proj", "qkv_proj")] = torch.cat(parts, dim=0)
        elif ".k_proj." not in name and ".v_proj." not in name:
            fused[name] = tensor
    return fused
