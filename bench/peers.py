"""Peers on the SAME weights as our engine: `transformers`' `OPTForCausalLM` run with
`generate` on static batches (left padding) and with its continuous-batching manager,
vLLM's CPU build (in its own virtualenv, through bench/vllm_driver.py) and, for a GGUF
model, llama.cpp on the file itself (llama-cpp-python, through bench/llamacpp_driver.py).

Token times come from a streamer (static batches) or the manager's timestamps, turned into
the same lifecycle events the engine emits, so bench.metrics treats both alike.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import transformers
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.streamers import BaseStreamer

from aserve.engine.sequence import Event
from bench.harness import OnFinish, RunResult
from bench.workloads import Workload
from models import registry
from models.loader import load_model
from models.opt import OPTConfig, OPTForCausalLM

STATIC_BATCH_SIZE = 16  # requests per `generate` call (the brief's peer setting)
CB_PAGE_SIZE = 32  # tokens per page of transformers' paged cache
CB_MAX_BATCH_TOKENS = 2048  # same token budget as our max_prefill_tokens default
QKV = ("q_proj", "k_proj", "v_proj")


def hf_config(cfg: OPTConfig, dtype: torch.dtype) -> transformers.OPTConfig:
    """The transformers config of the same architecture; EOS never ends generation."""
    return transformers.OPTConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        ffn_dim=cfg.ffn_dim, max_position_embeddings=cfg.max_position_embeddings,
        word_embed_proj_dim=cfg.word_embed_proj_dim,
        do_layer_norm_before=cfg.do_layer_norm_before,
        pad_token_id=cfg.pad_token_id, bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id, enable_bias=cfg.enable_bias,
        _remove_final_layer_norm=cfg.remove_final_layer_norm,
        layer_norm_elementwise_affine=cfg.layer_norm_elementwise_affine,
        dtype=dtype)


def hf_state_dict(ours: OPTForCausalLM) -> dict[str, torch.Tensor]:
    """Our parameters under transformers' names: the fused qkv_proj split into q/k/v."""
    state: dict[str, torch.Tensor] = {}
    for name, tensor in ours.state_dict().items():
        if ".qkv_proj." in name:
            for proj, part in zip(QKV, tensor.chunk(3, dim=0)):
                state[name.replace("qkv_proj", proj)] = part
        else:
            state[name] = tensor
    state["lm_head.weight"] = state["model.decoder.embed_tokens.weight"]
    return state


def build_hf_model(model: str, dtype: str, seed: int = 0,
                   max_position_embeddings: int | None = None
                   ) -> transformers.OPTForCausalLM:
    """transformers' OPT holding exactly the weights our loader gives `model` (preset + seed,
    or checkpoint directory): we build ours, then load its state dict into theirs."""
    ours, cfg = load_model(model, dtype, "cpu", seed, max_position_embeddings)
    torch_dtype = ours.model.decoder.embed_tokens.weight.dtype
    with torch.device("meta"):
        hf = transformers.OPTForCausalLM(hf_config(cfg, torch_dtype))
    hf.load_state_dict(hf_state_dict(ours), strict=True, assign=True)
    hf.tie_weights()
    hf.generation_config = greedy_config(cfg)
    return hf.eval().requires_grad_(False)


def greedy_config(cfg: OPTConfig) -> transformers.GenerationConfig:
    """Greedy decoding that never stops at EOS (outputs have the workload's lengths)."""
    return transformers.GenerationConfig(do_sample=False, eos_token_id=None,
                                         pad_token_id=cfg.pad_token_id)


class TokenTimes(BaseStreamer):
    """Records when `generate` hands over each step's tokens (the first call is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.num_calls = 0

    def put(self, value: torch.Tensor) -> None:
        if self.num_calls:
            self.times.append(time.perf_counter())
        self.num_calls += 1

    def end(self) -> None:
        pass


def run_static_generate(model: transformers.OPTForCausalLM, workload: Workload,
                        prompts: Sequence[list[int]], realtime: bool = True,
                        batch_size: int = STATIC_BATCH_SIZE, system: str = "transformers",
                        on_finish: OnFinish | None = None) -> RunResult:
    """Static batches: each `generate` call takes up to `batch_size` requests that have
    arrived (waiting for the next one when none has), left-padded, and runs to the longest
    output of the batch; a request finishes at its own output length."""
    warm_up(model, prompts)
    events: list[Event] = []
    token_ids: dict[str, list[int]] = {}
    start = time.perf_counter()
    pending = list(range(len(prompts)))
    while pending:
        now = time.perf_counter() - start
        arrived = [i for i in pending if not realtime or workload.requests[i].arrival_time <= now]
        if not arrived:
            time.sleep(workload.requests[pending[0]].arrival_time - now)
            continue
        batch = arrived[:batch_size]
        pending = [i for i in pending if i not in batch]
        _generate_batch(model, workload, prompts, batch, start, realtime, events, token_ids)
        for _ in batch:
            if on_finish is not None:
                on_finish()
    return RunResult(system, events, [], token_ids, time.perf_counter() - start)


def warm_up(model: transformers.OPTForCausalLM, prompts: Sequence[list[int]]) -> None:
    """One short `generate` call, so first-call costs stay out of the measured run (the
    engine gets the same courtesy)."""
    ids = torch.tensor([prompts[0][:8]] * 2)  # [2, <=8]
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2)


def _generate_batch(model: transformers.OPTForCausalLM, workload: Workload,
                    prompts: Sequence[list[int]], batch: list[int], start: float,
                    realtime: bool, events: list[Event], token_ids: dict[str, list[int]]
                    ) -> None:
    width = max(len(prompts[i]) for i in batch)
    pad = model.generation_config.pad_token_id
    rows = [[pad] * (width - len(prompts[i])) + prompts[i] for i in batch]
    ids = torch.tensor(rows)  # [batch, width]
    mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i])
                         for i in batch])  # [batch, width]
    num_new = max(workload.requests[i].output_len for i in batch)
    streamer = TokenTimes()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=num_new,
                             streamer=streamer)  # [batch, width + num_new]
    for row, i in enumerate(batch):
        req = workload.requests[i]
        arrival = start + req.arrival_time if realtime else start
        times = streamer.times[:req.output_len]
        token_ids[req.request_id] = out[row, width:width + req.output_len].tolist()
        events.extend(_token_events(req.request_id, arrival, times))


def _token_events(seq_id: str, arrival: float, times: Sequence[float]) -> list[Event]:
    events = [Event(seq_id, "arrival", arrival), Event(seq_id, "first_token", times[0])]
    events.extend(Event(seq_id, "token", t) for t in times[1:])
    events.append(Event(seq_id, "finish", times[-1]))
    return events


@contextlib.contextmanager
def paged_cache_shim() -> Iterator[None]:
    """NOTE: transformers 5.24's OPT decoder calls `cache.get_seq_length()`, which its
    `PagedAttentionCache` lacks, so continuous batching fails on OPT. The manager always
    passes explicit `position_ids`, so the length is only used to derive positions it
    already has: this shim answers 0 while the block runs, then removes itself."""
    had = "get_seq_length" in vars(PagedAttentionCache)
    if not had:
        PagedAttentionCache.get_seq_length = _no_past_length  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if not had:
            del PagedAttentionCache.get_seq_length  # type: ignore[attr-defined]


def _cb_generation_config(model: transformers.OPTForCausalLM) -> transformers.GenerationConfig:
    """A copy with EOS disabled the manager's way (-1): it would otherwise set that on the
    model's own config, which `generate` then warns about."""
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = -1
    return config


def _no_past_length(self: PagedAttentionCache, layer_idx: int = 0) -> int:
    return 0


def run_continuous_batching(model: transformers.OPTForCausalLM, workload: Workload,
                            prompts: Sequence[list[int]], realtime: bool = True,
                            system: str = "transformers-cb",
                            on_finish: OnFinish | None = None) -> RunResult:
    """transformers' continuous-batching manager (what `generate_batch` drives), fed each
    request at its arrival time with its own `max_new_tokens`; token timestamps recorded."""
    total = sum(len(p) + r.output_len for p, r in zip(prompts, workload.requests))
    cb_config = transformers.ContinuousBatchingConfig(
        page_size=CB_PAGE_SIZE, num_blocks=total // CB_PAGE_SIZE + 2 * len(prompts),
        max_batch_tokens=CB_MAX_BATCH_TOKENS, use_cuda_graph=False)
    warm_up(model, prompts)
    events: list[Event] = []
    token_ids: dict[str, list[int]] = {}
    with paged_cache_shim(), model.continuous_batching_context_manager(
            generation_config=_cb_generation_config(model), continuous_batching_config=cb_config,
            warmup=False) as manager:
        start = time.perf_counter()
        arrivals: dict[str, float] = {}
        for req, ids in zip(workload.requests, prompts, strict=True):
            if realtime:
                time.sleep(max(0.0, start + req.arrival_time - time.perf_counter()))
            arrivals[req.request_id] = time.perf_counter()
            manager.add_request(ids, request_id=req.request_id, max_new_tokens=req.output_len,
                                record_timestamps=True)
        while len(token_ids) < len(prompts):
            result = manager.get_result(timeout=60)
            if result is None:
                raise RuntimeError(f"transformers continuous batching stalled with "
                                   f"{len(prompts) - len(token_ids)} requests unfinished")
            if result.error is not None:
                raise RuntimeError(f"transformers request {result.request_id}: {result.error}")
            if result.is_finished():
                token_ids[result.request_id] = list(result.generated_tokens)
                events.extend(_token_events(result.request_id, arrivals[result.request_id],
                                            result.timestamps or []))
                if on_finish is not None:
                    on_finish()
    return RunResult(system, events, [], token_ids, time.perf_counter() - start)


VLLM_VENV = Path(__file__).resolve().parent.parent / ".venv-vllm"  # `make peers` builds it
VLLM_DRIVER = Path(__file__).resolve().parent / "vllm_driver.py"
VLLM_KVCACHE_GB = 4  # KV memory when the caller names none: room for every request here


def vllm_env(venv: Path, num_threads: int) -> dict[str, str]:
    """vLLM's documented CPU setup: every core computes (none reserved for the front end),
    OpenMP threads bound to them, its own libiomp5 preloaded. The KV cache size goes in
    the driver's input (`kv_cache_memory_bytes`), so the legacy variable must not be set."""
    env = dict(os.environ)
    env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{num_threads - 1}",
               VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    iomp = venv / "lib" / "libiomp5.so"
    if iomp.is_file():
        env["LD_PRELOAD"] = str(iomp)
    env.pop("PYTHONPATH", None)  # the driver imports vllm only, from its own environment
    return env


def save_checkpoint(model: str, dtype: str, seed: int, folder: Path) -> Path:
    """The Hub layout of `model` (config.json + safetensors): a checkpoint directory as it
    is, a GGUF file's dequantized tensors (`save_gguf_as_hf`), a preset's seeded weights
    written through transformers' `save_pretrained`."""
    source = registry.resolve(model)
    if source.kind == "directory":
        return Path(model)
    if source.kind == "gguf":
        assert source.path is not None
        return save_gguf_as_hf(Path(source.path), folder)
    build_hf_model(model, dtype, seed).save_pretrained(folder, safe_serialization=True)
    return folder


def save_gguf_as_hf(gguf_file: Path, folder: Path) -> Path:
    """A GGUF file as a HF directory vLLM loads: the tensors the gguf library dequantizes
    (float32, HF names and q/k order) as safetensors, a plain Llama-family config.json
    (no quantization_config) and the tokenizer as tokenizer.json."""
    from models import gguf_loader

    config = gguf_loader.hf_config(gguf_file)
    tensors = gguf_loader.read_tensors(gguf_file, config["num_attention_heads"],
                                       config["num_key_value_heads"])
    folder.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(tensors, str(folder / "model.safetensors"))
    config = {**config, "hidden_act": "silu", "torch_dtype": "float32",
              "head_dim": config["head_dim"] or (config["hidden_size"]
                                                 // config["num_attention_heads"])}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer = gguf_loader.load_gguf_tokenizer(gguf_file)
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    return folder


def run_vllm(model: str, dtype: str, seed: int, workload: Workload,
             prompts: Sequence[list[int]], realtime: bool = True, system: str = "vllm",
             on_finish: OnFinish | None = None, venv: Path = VLLM_VENV,
             kv_cache_bytes: int | None = None) -> RunResult:
    """vLLM's CPU build on the same weights and prompt token ids, greedy, EOS ignored, each
    request added at its arrival time (all at once unless `realtime`); run in a subprocess
    in its own virtualenv, through `LLMEngine.step` as `LLM.generate` runs it. Its KV cache
    gets `kv_cache_bytes` (the harness passes our decode device's, for equal memory), or
    `VLLM_KVCACHE_GB` GiB.

    Raises:
        RuntimeError: the virtualenv is missing (`make peers`) or the driver failed.
    """
    python = venv / "bin" / "python"
    if not python.is_file():
        raise RuntimeError(f"system 'vllm' needs the vllm-cpu virtualenv at {venv}: "
                           "run `make peers` first")
    with tempfile.TemporaryDirectory(prefix="aserve-vllm-") as tmp:
        folder = save_checkpoint(model, dtype, seed, Path(tmp) / "checkpoint")
        spec = {"model": str(folder), "dtype": dtype,
                "max_model_len": json.loads((folder / "config.json").read_text())[
                    "max_position_embeddings"],
                "kv_cache_bytes": kv_cache_bytes or VLLM_KVCACHE_GB * 2**30,
                "requests": _driver_requests(workload, prompts, realtime)}
        in_path, out_path = Path(tmp) / "in.json", Path(tmp) / "out.json"
        in_path.write_text(json.dumps(spec))
        threads = torch.get_num_threads()
        _run_driver([str(python), str(VLLM_DRIVER), str(in_path), str(out_path)],
                    vllm_env(venv, threads), Path(tmp) / "driver.log")
        out = json.loads(out_path.read_text())
    return _driver_result(workload, out, system, on_finish)


def _driver_requests(workload: Workload, prompts: Sequence[list[int]], realtime: bool
                     ) -> list[dict[str, Any]]:
    """The requests of a driver's input JSON (arrivals at 0 unless `realtime`)."""
    return [{"request_id": r.request_id, "prompt_token_ids": list(ids),
             "output_len": r.output_len, "arrival_time": r.arrival_time if realtime else 0.0}
            for r, ids in zip(workload.requests, prompts, strict=True)]


def _driver_result(workload: Workload, out: dict[str, Any], system: str,
                   on_finish: OnFinish | None) -> RunResult:
    """A driver's output JSON as the harness's events and token ids."""
    events: list[Event] = []
    token_ids: dict[str, list[int]] = {}
    for req in workload.requests:
        got = out["requests"][req.request_id]
        token_ids[req.request_id] = got["token_ids"]
        events.extend(_token_events(req.request_id, got["arrival"], got["times"]))
        if on_finish is not None:
            on_finish()
    return RunResult(system, events, [], token_ids, out["end"] - out["start"])


def _run_driver(argv: list[str], env: dict[str, str], log: Path) -> None:
    """Runs the driver in its own process group, so that vLLM's engine-core processes end
    with it even when the benchmark is interrupted."""
    with log.open("w") as f:
        proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait()
        finally:
            with contextlib.suppress(ProcessLookupError):  # the group is gone on success
                os.killpg(proc.pid, signal.SIGKILL)
    if code != 0:
        raise RuntimeError(f"{Path(argv[1]).stem} exited with {code}:\n"
                           f"{log.read_text()[-4000:]}")


LLAMACPP_DRIVER = Path(__file__).resolve().parent / "llamacpp_driver.py"


def run_llamacpp(model: str, workload: Workload, prompts: Sequence[list[int]],
                 realtime: bool = True, system: str = "llamacpp",
                 on_finish: OnFinish | None = None, venv: Path = VLLM_VENV) -> RunResult:
    """llama.cpp (llama-cpp-python, in the peers virtualenv) on the model's own GGUF file,
    with the same prompt token ids, greedy, exactly `output_len` tokens per request, one
    request at a time as its high-level API serves them (in arrival order).

    Raises:
        RuntimeError: the model is not a GGUF file, the virtualenv or its llama_cpp is
            missing, or the driver failed.
    """
    source = registry.resolve(model)
    if source.kind != "gguf" or source.path is None:
        raise RuntimeError(f"system 'llamacpp' runs GGUF files; model {model!r} is not one")
    python = venv / "bin" / "python"
    if not python.is_file():
        raise RuntimeError(f"system 'llamacpp' needs llama-cpp-python in {venv}: run "
                           "`make peers`")
    with tempfile.TemporaryDirectory(prefix="aserve-llamacpp-") as tmp:
        spec = {"model": source.path, "threads": torch.get_num_threads(),
                "n_ctx": max(len(ids) + r.output_len
                             for r, ids in zip(workload.requests, prompts, strict=True)) + 8,
                "requests": _driver_requests(workload, prompts, realtime)}
        in_path, out_path = Path(tmp) / "in.json", Path(tmp) / "out.json"
        in_path.write_text(json.dumps(spec))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_PRELOAD")}
        _run_driver([str(python), str(LLAMACPP_DRIVER), str(in_path), str(out_path)], env,
                    Path(tmp) / "driver.log")
        out = json.loads(out_path.read_text())
    return _driver_result(workload, out, system, on_finish)
