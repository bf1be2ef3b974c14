"""Multi-process and DeepSpeed test infrastructure: run a script on 2 CPU ranks (gloo) under
``accelerate launch``, optionally with DeepSpeed ZeRO-2/3, and check what each rank reports.

Not a test module: the trainer tests import it (``tests/`` is on ``sys.path`` under pytest), and the
scripts they launch import its script-side helpers (:func:`run_script` puts ``tests/`` on their
``PYTHONPATH``). The launch uses the user-facing accelerate configs of
``examples/accelerate_configs/`` unchanged, plus what CPU needs:

- ``accelerate launch --cpu`` would start ONE process, so the GPU launch paths (``MULTI_GPU`` and
  ``DEEPSPEED`` configs) are used; on a machine without CUDA their ranks talk over gloo.
- The script itself must ask for CPU: ``TrainingArguments(use_cpu=True)`` (``--use_cpu`` on an
  ``HfArgumentParser`` command line), or ``PartialState(cpu=True)`` before ``Accelerator()``. Without
  it each rank silently trains alone (``DistributedType.NO``) under the ``MULTI_GPU`` config, and
  DeepSpeed fails on its batch-size check.
- ``ACCELERATE_USE_CPU=true`` in the environment is removed: it makes ``Accelerator`` drop the
  DeepSpeed plugin silently (DDP instead of ZeRO).
- ``CUDA_VISIBLE_DEVICES=""`` and ``DS_ACCELERATOR=cpu``: on a GPU machine too, the ranks stay on the
  CPU (two ranks on one GPU would fail under NCCL).
- ``OMP_NUM_THREADS=1`` (2 ranks on 2 cores), offline Hugging Face flags, a free rendezvous port per
  run (concurrent test sessions on one machine would collide on accelerate's default 29500).

DeepSpeed's first start on a machine JIT-compiles its CPU shared-memory comm op (about 1.5 min on 2
cores), cached in ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions/py<XY>_cpu``); later
starts load it in a second.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "ACCELERATE_CONFIGS",
    "CONFIG_DIR",
    "REPO_ROOT",
    "TESTS_DIR",
    "deepspeed_available",
    "free_port",
    "gathered",
    "launch_command",
    "launch_env",
    "parameter_digest",
    "read_rank_results",
    "requires_deepspeed",
    "run_script",
    "write_rank_result",
]

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
CONFIG_DIR = REPO_ROOT / "examples" / "accelerate_configs"
#: The accelerate config (a file in CONFIG_DIR) for each `deepspeed` value of run_script, 2+ processes.
ACCELERATE_CONFIGS: dict[str | None, str] = {
    None: "multi_gpu.yaml",
    "zero2": "deepspeed_zero2.yaml",
    "zero3": "deepspeed_zero3.yaml",
}
_SINGLE_PROCESS_CONFIG = "single_gpu.yaml"

# Variables a parent process (a test session started under torchrun or accelerate) could leak into the
# launch and that would confuse it.
_DROPPED_ENV_PREFIXES = ("ACCELERATE_", "FSDP_", "TORCHELASTIC_")
_DROPPED_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


# --------------------------------------------------------------------------------------------------
# Launcher side (the pytest process)
# --------------------------------------------------------------------------------------------------


def deepspeed_available() -> bool:
    """Whether ``deepspeed`` is installed. Only looks it up (importing it takes seconds); a broken
    install is not hidden behind a skip: the launched script fails loudly instead."""
    return importlib.util.find_spec("deepspeed") is not None


#: Skips a test only when DeepSpeed is not installed (CI installs it, so CI runs these tests).
#: Combine with ``pytest.mark.deepspeed`` so ``-m deepspeed`` / ``-m "not deepspeed"`` select them.
requires_deepspeed = pytest.mark.skipif(
    not deepspeed_available(),
    reason='needs DeepSpeed: DS_BUILD_OPS=0 pip install "deepspeed==0.19.*" (the `deepspeed` extra)',
)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, for the ranks' rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_command(
    script: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    num_processes: int = 2,
    deepspeed: str | None = None,
    port: int | None = None,
) -> list[str]:
    """The ``accelerate launch`` command line of :func:`run_script` (without its environment)."""
    if deepspeed not in ACCELERATE_CONFIGS:
        raise ValueError(f"deepspeed={deepspeed!r}: must be None, 'zero2' or 'zero3'.")
    if num_processes < 1:
        raise ValueError(f"num_processes={num_processes}: must be at least 1.")
    if deepspeed is None and num_processes == 1:
        config = CONFIG_DIR / _SINGLE_PROCESS_CONFIG
    else:
        config = CONFIG_DIR / ACCELERATE_CONFIGS[deepspeed]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    command += ["--num_processes", str(num_processes)]
    if num_processes > 1:
        command += ["--main_process_port", str(port if port is not None else free_port())]
    return [*command, str(script), *map(str, args)]


def launch_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of :func:`run_script`: this process's, made CPU-safe and offline, then `env`."""
    result = {
        k: v
        for k, v in os.environ.items()
        if k not in _DROPPED_ENV and not k.startswith(_DROPPED_ENV_PREFIXES)
    }
    result.update(
        {
            "CUDA_VISIBLE_DEVICES": "",
            "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")])),
        }
    )
    result.update(env or {})
    return result


def _kill_tree(pid: int, grace: float = 5.0) -> None:
    """End process `pid` and all its descendants. torch's elastic agent starts each rank in a session of
    its own, so killing the launcher's process group leaves the ranks running, holding the output pipes
    open: collect the whole tree first, SIGTERM it (the agent forwards it to the ranks), then SIGKILL
    whatever is left."""
    import psutil  # a dependency of accelerate

    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(tree, timeout=grace)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=grace)


def _tail(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])


def run_script(
    script: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    num_processes: int = 2,
    deepspeed: str | None = None,
    timeout: float = 600,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    tail_lines: int = 80,
) -> subprocess.CompletedProcess[str]:
    """Run `script` with `args` on `num_processes` CPU ranks (gloo) under ``accelerate launch``.

    Args:
        script: path of the Python script (relative paths are taken from ``tests/scripts/``,
            then from the current directory).
        args: its command-line arguments.
        num_processes: ranks to start (1 runs the single-process config unless `deepspeed` is given).
        deepspeed: None (DDP), "zero2" or "zero3": which ``examples/accelerate_configs/`` file to use.
            The script must run on CPU by itself (``TrainingArguments(use_cpu=True)``), see the module
            docstring.
        timeout: seconds before the whole process group is killed (an AssertionError follows).
        env: extra environment variables, applied last (they override the CPU-safe defaults).
        cwd: working directory of the launch (default: the repository root).
        tail_lines: how many last lines of stdout and stderr an AssertionError shows.

    Returns:
        the completed process (``returncode`` 0), with ``stdout`` and ``stderr`` as text and the wall
        time in seconds as an extra attribute ``seconds``.

    Raises:
        AssertionError: the launch exited non-zero or timed out; the message holds the command and the
            tails of stdout and stderr.
    """
    path = Path(script)
    if not path.is_absolute() and (TESTS_DIR / "scripts" / path).is_file():
        path = TESTS_DIR / "scripts" / path
    if not path.is_file():
        raise FileNotFoundError(f"no script {script!s} (looked in {TESTS_DIR / 'scripts'} and {Path.cwd()}).")
    command = launch_command(path, args, num_processes=num_processes, deepspeed=deepspeed)
    started = time.perf_counter()
    with subprocess.Popen(
        command,
        cwd=str(cwd or REPO_ROOT),
        env=launch_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    ) as process:
        timed_out = False
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_tree(process.pid)
            stdout, stderr = process.communicate(timeout=60)
    seconds = time.perf_counter() - started
    completed = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    completed.seconds = seconds  # type: ignore[attr-defined]
    if timed_out or process.returncode != 0:
        what = f"timed out after {timeout:.0f} s" if timed_out else f"exited with {process.returncode}"
        raise AssertionError(
            f"{path.name} on {num_processes} process(es), deepspeed={deepspeed!r}: {what} "
            f"({seconds:.1f} s).\ncommand: {' '.join(command)}\n"
            f"--- stdout (last {tail_lines} lines) ---\n{_tail(stdout, tail_lines)}\n"
            f"--- stderr (last {tail_lines} lines) ---\n{_tail(stderr, tail_lines)}"
        )
    return completed


def read_rank_results(output_dir: str | os.PathLike[str], num_processes: int = 2) -> list[dict[str, Any]]:
    """The results written by :func:`write_rank_result` of ranks 0..num_processes-1, in rank order.

    Asserts that every rank wrote one, and that each saw ``num_processes`` ranks: a script that forgot
    ``use_cpu=True`` runs N independent single-process copies, which this catches.
    """
    results = []
    for rank in range(num_processes):
        path = Path(output_dir) / f"result-rank{rank}.json"
        assert path.is_file(), f"rank {rank} wrote no result ({path} missing)"
        result = json.loads(path.read_text())
        assert result.get("rank") == rank, f"{path} says rank {result.get('rank')}"
        assert result.get("world_size") == num_processes, (
            f"rank {rank} saw world size {result.get('world_size')}, expected {num_processes} "
            "(did the script ask for CPU with use_cpu=True?)"
        )
        results.append(result)
    return results


# --------------------------------------------------------------------------------------------------
# Script side (inside the launched ranks)
# --------------------------------------------------------------------------------------------------


def gathered(model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
    """A context in which `model`'s parameters are whole: under ZeRO-3 each rank holds only a slice,
    and this gathers them (read-only; a collective, so every rank must enter). Elsewhere, a no-op."""
    params = list(model.parameters())
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return contextlib.nullcontext()


def parameter_digest(model: torch.nn.Module) -> tuple[str, int]:
    """SHA-256 over `model`'s named parameters (as fp32 bytes, sorted by name) and their element count,
    gathered under ZeRO-3. Equal digests mean bitwise-equal weights."""
    import torch

    digest, numel = hashlib.sha256(), 0
    with gathered(model), torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            tensor = param.detach().to("cpu", torch.float32).contiguous()
            digest.update(name.encode())
            digest.update(str(tuple(tensor.shape)).encode())
            digest.update(tensor.numpy().tobytes())
            numel += tensor.numel()
    return digest.hexdigest(), numel


def write_rank_result(output_dir: str | os.PathLike[str], rank: int, result: Mapping[str, Any]) -> Path:
    """Write this rank's `result` (JSON-serialisable) to ``<output_dir>/result-rank<rank>.json``."""
    path = Path(output_dir) / f"result-rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rank": rank, **result}, indent=2, sort_keys=True) + "\n")
    return path
