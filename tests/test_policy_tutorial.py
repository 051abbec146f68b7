"""docs/policy-tutorial.md runs as written: its Python blocks, in order, in one fresh
interpreter (the policy it registers stays out of this test process's registry)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "docs" / "policy-tutorial.md"


def test_the_policy_tutorial_runs(tmp_path: Path) -> None:
    blocks = re.findall(r"<!-- test: tutorial -->\n```python\n(.*?)```", TUTORIAL.read_text(),
                        flags=re.DOTALL)
    assert len(blocks) == 4, "the tutorial lost a tested step"
    script = tmp_path / "tutorial.py"
    script.write_text("\n".join(blocks))
    result = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "['short']"  # the shortest pooled request is batched first
    rates = {line.split()[0]: float(line.split()[1]) for line in lines[1:4]}
    assert set(rates) == {"shortest-first", "aligned", "fcfs"}
    assert all(rate > 0 for rate in rates.values())  # every request ran in the simulator
    served = lines[4:]
    assert len(served) == 3 and all(line.startswith("length ") for line in served)
