"""The host allocator settings: a decode-like pattern of growing activations stops faulting."""

import os
import platform
import subprocess
import sys

GLIBC = platform.libc_ver()[0] == "glibc"  # elsewhere the allocator is left alone

# Logits and MLP activations of batches growing 1..64 rows, three times over, as decode does.
PATTERN = """
import resource, sys, torch
from aserve.engine.host import tune_host_allocator
tuned = tune_host_allocator() if sys.argv[1] == "tune" else False
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for rows in list(range(1, 65)) * 3:
    logits = torch.empty(rows, 50272).fill_(1)
    hidden = torch.empty(rows, 3072).fill_(1)
    del logits, hidden
print(tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def run_pattern(mode: str, **env: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PATTERN, mode], check=True, text=True,
                         capture_output=True, env={**os.environ, **env}).stdout.split()
    return out[0], int(out[1])


def test_tuned_allocator_stops_refaulting_freed_activations():
    tuned, tuned_faults = run_pattern("tune")
    untuned, default_faults = run_pattern("default")
    assert (tuned, untuned) == (str(GLIBC), "False")
    if not GLIBC:
        return
    # 192 steps of up to 13.6 MB each: glibc's default faults most of it back in every time
    # (about 100k pages here); with fixed thresholds the heap keeps the pages.
    assert default_faults > 20_000
    assert tuned_faults < default_faults / 5


def test_users_own_allocator_choice_is_left_alone():
    assert run_pattern("tune", MALLOC_MMAP_THRESHOLD_="65536")[0] == "False"
    assert run_pattern("tune", LD_PRELOAD="")[0] == str(GLIBC)
    assert run_pattern("tune", ASERVE_MALLOC_TUNING="0")[0] == "False"



# A CPU engine generating, then the process's threads that Python did not start (OpenMP's
# workers, OpenBLAS's): counted before the engine and while it is up.
ONE_TEAM = """
import os, threading
import aserve
import torch
from aserve import LLM, SamplingParams

def native_threads():
    return len(os.listdir("/proc/self/task")) - threading.active_count()

before = native_threads()
with LLM(model="opt-tiny", dtype="float32", block_size=256, num_decode_blocks=8,
         num_prefill_blocks=8, num_staging_blocks=8, host_pool_gb=0.05) as llm:
    llm.generate([[2, 40, 41, 42]], SamplingParams(max_tokens=4, ignore_eos=True))
    print(torch.get_num_threads(), native_threads() - before)
"""


def test_a_cpu_engine_keeps_its_openmp_work_in_one_thread():
    # one team: the runner's thread and num_threads - 1 workers. A second thread that ran a
    # parallel region would keep a team of its own, and GNU OpenMP would then stop spinning
    # idle threads (aserve/__init__.py): every region of a step would wake a sleeping one.
    out = subprocess.run([sys.executable, "-c", ONE_TEAM], check=True, text=True,
                         capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    threads, workers = map(int, out.stdout.split())
    assert (threads, workers) == (2, 1)


OPENMP = """
import sys
if sys.argv[1] == "torch first":
    import torch
import aserve, os
print(aserve.OPENMP_WAITS, "|", os.environ.get("GOMP_SPINCOUNT"), os.environ.get("KMP_BLOCKTIME"))
"""


def openmp_waits(order: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    return subprocess.run([sys.executable, "-c", OPENMP, order], check=True, text=True,
                          capture_output=True, env={**clean, **env}).stdout.strip()


def test_idle_openmp_threads_spin_briefly_unless_told_otherwise():
    assert openmp_waits("aserve first") == (
        "GOMP_SPINCOUNT=10000 KMP_BLOCKTIME=1 | 10000 1")
    # the user's word stands, and nothing is added to it
    assert openmp_waits("aserve first", OMP_WAIT_POLICY="PASSIVE") == (
        "OMP_WAIT_POLICY=PASSIVE | None None")
    # torch loaded first has read its settings already: said, not changed
    assert openmp_waits("torch first") == (
        "the OpenMP runtime's defaults (torch was loaded before aserve) | None None")
