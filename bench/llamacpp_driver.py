"""Runs one workload through llama.cpp (llama-cpp-python) on a GGUF file, and writes each
request's tokens and token times. Runs inside the peers virtualenv (`make peers`), never in
ours: it imports only llama_cpp and the standard library. `bench.peers.run_llamacpp` writes
its input and reads its output (the same JSON as bench/vllm_driver.py, plus "threads" and
"n_ctx").

llama-cpp-python's `Llama` serves one sequence at a time: requests run one after the other
in arrival order, each greedy for exactly its `output_len` tokens (EOS ignored).
"""

from __future__ import annotations

import json
import sys
import time


def main(in_path: str, out_path: str) -> None:
    from llama_cpp import Llama

    spec = json.loads(open(in_path).read())
    llm = Llama(model_path=spec["model"], n_ctx=spec["n_ctx"], n_threads=spec["threads"],
                n_threads_batch=spec["threads"], n_batch=512, logits_all=False, verbose=False)
    requests = sorted(spec["requests"], key=lambda r: r["arrival_time"])

    def generate(prompt: list[int], n: int) -> tuple[list[int], list[float]]:
        tokens: list[int] = []
        times: list[float] = []
        # NOTE: reset=True drops the previous request's KV: no prefix reuse across requests
        for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0,
                                  reset=True):
            tokens.append(int(token))
            times.append(time.perf_counter())
            if len(tokens) == n:
                break
        return tokens, times

    generate(requests[0]["prompt_token_ids"][:8], 2)  # warm-up, as the other systems get
    out: dict[str, dict[str, object]] = {}
    start = time.perf_counter()
    for r in requests:
        arrival = start + r["arrival_time"]
        time.sleep(max(0.0, arrival - time.perf_counter()))
        tokens, times = generate(r["prompt_token_ids"], r["output_len"])
        out[r["request_id"]] = {"token_ids": tokens, "times": times, "arrival": arrival}
    end = time.perf_counter()
    with open(out_path, "w") as f:
        json.dump({"start": start, "end": end, "requests": out}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
