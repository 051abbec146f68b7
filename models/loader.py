"""Builds a model: OPT or the Llama family from a HF checkpoint directory, the Llama family
from a GGUF file, or a preset with seeded random weights. Validates everything it reads;
never executes code from a pickle.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import safetensors.torch
import torch
from torch import Tensor, nn

from models import registry
from models.llama import PRESETS as LLAMA_PRESETS
from models.llama import LlamaConfig, LlamaForCausalLM, inverse_frequencies
from models.opt import OPTConfig, OPTForCausalLM
from models.registry import OPT_ARCHITECTURES

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}
INIT_STD = 0.02  # std of the normal init of weights and embeddings, as HF's init_std
INIT_CHUNK = 1 << 24  # elements generated at a time by the preset init
QKV = ("q_proj", "k_proj", "v_proj")  # HF's separate projections, in fused-row order
M = TypeVar("M", bound=nn.Module)


class LoadedModel(NamedTuple):
    model: Any  # OPTForCausalLM or LlamaForCausalLM (same forward / compute_logits)
    config: Any  # OPTConfig or LlamaConfig


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A dtype by name or value; raises ValueError listing the supported ones."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype {dtype!r} is unsupported; valid: {', '.join(DTYPES)}")


def load_model(model: str, dtype: str | torch.dtype, device: torch.device | str, seed: int = 0,
               max_position_embeddings: int | None = None) -> LoadedModel:
    """A random-weight preset (weights from `seed`), a packaged model, a checkpoint
    directory or a GGUF file (`models.registry.resolve`).

    A checkpoint keeps its own position limit: asking for a longer one raises ValueError.
    """
    torch_dtype = resolve_dtype(dtype)
    source = registry.resolve(model)
    if source.kind == "opt-preset":
        return build_preset(model, torch_dtype, device, seed, max_position_embeddings)
    if source.kind == "llama-preset":
        return build_random(load_config(model, max_position_embeddings), LlamaForCausalLM,
                            torch_dtype, device, seed)
    assert source.path is not None
    if source.kind == "gguf":
        loaded = load_gguf(source.path, torch_dtype, device)
    elif registry.architecture(registry.read_hf_config(source.path)) in OPT_ARCHITECTURES:
        loaded = load_checkpoint(source.path, torch_dtype, device)
    else:
        loaded = load_llama_checkpoint(source.path, torch_dtype, device)
    limit = loaded.config.max_position_embeddings
    if max_position_embeddings is not None and max_position_embeddings > limit:
        raise ValueError(f"max_position_embeddings ({max_position_embeddings}) exceeds the "
                         f"checkpoint's limit ({limit})")
    return loaded


def load_config(model: str, max_position_embeddings: int | None = None) -> Any:
    """The architecture (`OPTConfig` or `LlamaConfig`) of what `model` names, without its
    weights."""
    source = registry.resolve(model)
    if source.kind == "opt-preset":
        return OPTConfig.from_name(model, max_position_embeddings)
    if source.kind == "llama-preset":
        extra = {} if max_position_embeddings is None else {
            "max_position_embeddings": max_position_embeddings}
        return LlamaConfig(**{**LLAMA_PRESETS[model], **extra})
    assert source.path is not None
    if source.kind == "gguf":
        from models import gguf_loader

        return LlamaConfig.from_hf_config(gguf_loader.hf_config(source.path))
    config = {**registry.read_hf_config(source.path), **_generation_tokens(Path(source.path))}
    if registry.architecture(config) in OPT_ARCHITECTURES:
        return OPTConfig.from_hf_config(config)
    return LlamaConfig.from_hf_config(config)


def build_preset(name: str, dtype: torch.dtype, device: torch.device | str, seed: int = 0,
                 max_position_embeddings: int | None = None) -> LoadedModel:
    """OPT preset geometry with random weights (`build_random`)."""
    return build_random(OPTConfig.from_name(name, max_position_embeddings), OPTForCausalLM,
                        dtype, device, seed)


def build_random(cfg: Any, model_class: type[nn.Module], dtype: torch.dtype,
                 device: torch.device | str, seed: int = 0) -> LoadedModel:
    """`model_class(cfg)` with random weights: normal(0, 0.02), zero biases, norms 1/0.

    Values come from a CPU generator in `dtype`, chunk by chunk, so they are the same for a
    seed on any device and a big preset never needs a float32 copy of itself.
    """
    with torch.device("meta"):
        model = model_class(cfg).to(dtype)
    model.to_empty(device=device)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.fill_(1.0 if param_name.endswith("weight") else 0.0)
            elif param_name.endswith("bias"):
                param.zero_()
            else:
                _fill_normal(param, generator)
    _restore_buffers(model, cfg)
    return LoadedModel(_finish(model), cfg)


def _restore_buffers(model: nn.Module, cfg: Any) -> None:
    """Computed buffers (rotary frequencies), which `to_empty` leaves uninitialised."""
    if isinstance(model, LlamaForCausalLM):
        model.model.inv_freq = inverse_frequencies(cfg).to(model.model.embed_tokens.weight.device)


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


def _finish(model: M) -> M:
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


FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}  # HF -> fused rows


def load_llama_checkpoint(path: str | Path, dtype: torch.dtype, device: torch.device | str
                          ) -> LoadedModel:
    """A Llama / Mistral / Qwen2 HF directory: config.json plus safetensors (or plain
    weight pickles), single or sharded.

    Raises:
        ValueError: an unsupported config, or missing / unexpected / mis-shaped tensors.
    """
    root = Path(path)
    cfg = LlamaConfig.from_hf_config({**registry.read_hf_config(root),
                                      **_generation_tokens(root)})
    return _build_llama(cfg, _read_weights(root), dtype, device)


def load_gguf(path: str | Path, dtype: torch.dtype, device: torch.device | str) -> LoadedModel:
    """A Llama-family GGUF file, its tensors dequantized by the `gguf` library.

    Raises:
        ValueError: an unsupported architecture or tensor type (named), or bad tensors.
    """
    from models import gguf_loader  # the gguf library, only for GGUF files

    cfg = LlamaConfig.from_hf_config(gguf_loader.hf_config(path))
    tensors = gguf_loader.read_tensors(path, cfg.num_heads, cfg.num_kv_heads)
    return _build_llama(cfg, tensors, dtype, device)


def _build_llama(cfg: LlamaConfig, tensors: dict[str, Tensor], dtype: torch.dtype,
                 device: torch.device | str) -> LoadedModel:
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    state = _llama_state_dict(tensors, model)
    model.load_state_dict({name: t.to(device=device, dtype=dtype) for name, t in state.items()},
                          strict=True, assign=True)
    _restore_buffers(model, cfg)
    return LoadedModel(_finish(model), cfg)


def _llama_state_dict(tensors: dict[str, Tensor], model: LlamaForCausalLM
                      ) -> dict[str, Tensor]:
    """Renames HF tensors to this model's names (fusing q/k/v and gate/up), checking names
    and shapes; a tied model's stored `lm_head.weight` is checked, then dropped."""
    own = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    parts: dict[str, dict[int, Tensor]] = {}
    found: dict[str, Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue  # computed from the config
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            if tuple(tensor.shape) != own["model.embed_tokens.weight"]:
                raise ValueError(f"checkpoint tensor 'lm_head.weight' has shape "
                                 f"{tuple(tensor.shape)}, expected "
                                 f"{own['model.embed_tokens.weight']}")
            continue
        key = name.replace(".mlp.", ".")
        prefix, _, kind = key.rpartition(".")
        base, _, proj = prefix.rpartition(".")
        if proj in FUSED:
            fused, slot = FUSED[proj]
            parts.setdefault(f"{base}.{fused}.{kind}", {})[slot] = tensor
        else:
            found[key] = tensor
    for key, slots in parts.items():
        count = 3 if ".qkv_proj." in key else 2
        if sorted(slots) != list(range(count)):
            raise ValueError(f"checkpoint has only some of the tensors of {key}")
        found[key] = torch.cat([slots[i] for i in range(count)], dim=0)
    unexpected = sorted(set(found) - set(own))
    if unexpected:
        raise ValueError(f"checkpoint tensors {unexpected[:3]} are unexpected for this "
                         f"{model.config.architecture} config")
    missing = sorted(set(own) - set(found))
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    for key, tensor in found.items():
        if tuple(tensor.shape) != own[key]:
            raise ValueError(f"checkpoint tensor {key!r} has shape {tuple(tensor.shape)}, "
                             f"expected {own[key]}")
    return found
