"""The engine's parts change no number a user sees: PPO, RLOO and GRPO, with and without LoRA, on 1 process
and on 2, log the same metrics, update by update, as the code before issue #47's restructure did.

``tests/data/same_metrics.json`` holds what ``tests/scripts/same_metrics.py`` logged on main at e4c7c00 (the
last commit before the engine was split into parts), on the CPU named in the file. On that CPU model the
numbers must agree to 1e-6 (relative, with 1e-6 absolute for values near 0); another CPU's float kernels
may round differently, so there the bar is 1e-3 and the test says which bar it used. Every recorded metric
must still be logged; metrics added since may be.

To record new reference numbers (only for a deliberate change of results, said in the commit):
``RLHF_RECORD_SAME_METRICS=1 python -m pytest tests/test_same_metrics.py``.
"""

from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path

import pytest
from distributed import read_rank_results, run_script

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

REFERENCE = Path(__file__).parent / "data" / "same_metrics.json"
RUNS = ("ppo", "ppo-lora", "rloo", "rloo-lora", "grpo", "grpo-lora")


def cpu_model() -> str:
    """The CPU's model name (its float kernels decide the last bits of every result)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _differences(expected: dict, got: dict, rel: float, where: str) -> list[str]:
    problems = []
    missing = sorted(set(expected) - set(got))
    if missing:  # (new metrics may be added; none of the recorded ones may go)
        problems.append(f"{where}: metrics no longer logged: {missing}")
    for name in sorted(set(expected) & set(got)):
        a, b = expected[name], got[name]
        if math.isfinite(a) and not math.isclose(a, b, rel_tol=rel, abs_tol=rel):
            problems.append(f"{where} {name}: reference {a!r}, now {b!r}")
        elif not math.isfinite(a) and a != b:
            problems.append(f"{where} {name}: reference {a!r}, now {b!r}")
    return problems


@pytest.mark.parametrize("num_processes", [1, 2])
def test_metrics_match_the_code_before_the_restructure(tmp_path, num_processes):
    run_script("same_metrics.py", ["--output_dir", str(tmp_path)], num_processes=num_processes, timeout=1200)
    rank0 = read_rank_results(tmp_path, num_processes)[0]
    key = f"{num_processes}-process"
    if os.environ.get("RLHF_RECORD_SAME_METRICS"):
        data = json.loads(REFERENCE.read_text()) if REFERENCE.is_file() else {}
        data["cpu"] = cpu_model()
        data[key] = rank0["runs"]
        REFERENCE.parent.mkdir(parents=True, exist_ok=True)
        REFERENCE.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"recorded {key} reference metrics into {REFERENCE}")
    reference = json.loads(REFERENCE.read_text())
    rel = 1e-6 if reference["cpu"] == cpu_model() else 1e-3
    assert sorted(rank0["runs"]) == sorted(RUNS)
    problems = []
    for run in RUNS:
        expected, got = reference[key][run], rank0["runs"][run]
        assert len(got["logs"]) == len(expected["logs"]), (run, len(got["logs"]), len(expected["logs"]))
        assert len(expected["logs"]) >= 3, run  # several updates, each compared
        for i, (a, b) in enumerate(zip(expected["logs"], got["logs"], strict=True)):
            problems += _differences(a, b, rel, f"{run} log {i}")
        problems += _differences(expected["eval"], got["eval"], rel, f"{run} eval")
    assert not problems, (
        f"{len(problems)} differences at rel {rel} (reference CPU {reference['cpu']!r}, this one "
        f"{cpu_model()!r}):\n" + "\n".join(problems[:40])
    )
