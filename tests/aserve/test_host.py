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

