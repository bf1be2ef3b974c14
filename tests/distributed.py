"""Multi-process and DeepSpeed test infrastructure: run a script on 2 CPU ranks (gloo) as
``accelerate launch`` starts them, optionally with DeepSpeed ZeRO-2/3, and check what each rank reports.
The ranks are forks of tests/forked.py's preloaded server with the environments accelerate computes
(:func:`rank_environments`), or ``accelerate launch`` itself (``run_script(launcher="accelerate")``,
or ``RLHF_TESTS_LAUNCHER=accelerate`` for every launch).

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

DeepSpeed's first start in a virtual environment JIT-compiles its CPU shared-memory comm op (~35 s on 2
idle cores), cached in ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions/py<XY>_cpu``); later
starts from the same environment load it in a second (a new environment compiles it again).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import hashlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from file_syncs import can_record, record_file_syncs
from transformers import TrainerCallback

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import Trainer

    from rlhf_trainers.testing import OfflineKit

__all__ = [
    "ACCELERATE_CONFIGS",
    "CONFIG_DIR",
    "LAUNCHERS",
    "ONPOLICY_MODES",
    "REPO_ROOT",
    "TESTS_DIR",
    "CountUpdates",
    "OnPolicyRuns",
    "Run",
    "check_first_update_like_ddp",
    "check_launch",
    "check_resume",
    "check_saved_policy",
    "deepspeed_available",
    "free_port",
    "gathered",
    "launch_command",
    "launch_env",
    "onpolicy_config_kwargs",
    "onpolicy_parser",
    "parameter_digest",
    "parse_onpolicy_args",
    "rank_environments",
    "read_rank_results",
    "requires_deepspeed",
    "run_script",
    "train_and_report",
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


#: Age (seconds) after which a torch extension's build ``lock`` is taken as left behind by a killed build.
#: A JIT build (DeepSpeed's CPU comm op, ~35 s on 2 idle cores) holds ``<build folder>/lock`` while it
#: compiles; one killed mid-way (a timeout, a machine restart) leaves it, and every later start waits on it
#: forever (torch's ``FileBaton.wait`` has no timeout): each DeepSpeed test then runs into its own timeout.
STALE_BUILD_LOCK_S = 900.0


def torch_extensions_root() -> Path:
    """Where torch JIT-builds extensions: ``$TORCH_EXTENSIONS_DIR``, else torch's default per-user cache
    folder with its ``py<XY>_<cpu|cuXYZ|rocmXY>`` sub-folder (the rule of ``torch.utils.cpp_extension``)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accelerator = "cu" + torch.version.cuda.replace(".", "")
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def clear_stale_build_locks(root: Path | None = None, max_age_s: float = STALE_BUILD_LOCK_S) -> list[Path]:
    """Remove build locks older than `max_age_s` under `root` (default :func:`torch_extensions_root`).

    Returns the removed paths (each also reported on stderr). A lock younger than that may belong to a
    build in progress (another test session's) and is left alone.
    """
    root = torch_extensions_root() if root is None else root
    removed = []
    for lock in sorted(root.glob("*/lock")):
        with contextlib.suppress(FileNotFoundError):
            age = time.time() - lock.stat().st_mtime
            if age > max_age_s:
                lock.unlink()
                removed.append(lock)
                print(
                    f"removed {lock}: a torch extension build lock {age:.0f} s old (over {max_age_s:.0f} s), "
                    "left by a build that was killed; every DeepSpeed start would wait on it forever.",
                    file=sys.stderr,
                )
    return removed


#: How run_script starts the ranks unless a call says: "forked" (default) or "accelerate";
#: ``RLHF_TESTS_LAUNCHER=accelerate`` runs every launch of the suite through ``accelerate launch``.
LAUNCHERS = ("forked", "accelerate")


def _default_launcher() -> str:
    launcher = os.environ.get("RLHF_TESTS_LAUNCHER", "forked")
    if launcher not in LAUNCHERS:
        raise ValueError(f"RLHF_TESTS_LAUNCHER={launcher!r}: must be one of {LAUNCHERS}.")
    return launcher


@contextlib.contextmanager
def _environment(env: Mapping[str, str], cwd: str | os.PathLike[str]):
    """Inside, ``os.environ`` is ``env`` and the working directory ``cwd`` (accelerate's launch helpers
    copy ``os.environ`` and read the working directory), as before after."""
    saved, here = dict(os.environ), os.getcwd()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(saved)


def rank_environments(
    command: Sequence[str], env: Mapping[str, str], cwd: str | os.PathLike[str]
) -> list[dict[str, str]]:
    """The environment of each rank that ``command`` (a :func:`launch_command` line) would start from
    ``cwd``, as ``accelerate launch`` computes it (its own parser, checks and ``prepare_*_env`` functions,
    run on ``env``) plus what torch's elastic agent gives each worker (``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, ...); accelerate's single-process launch runs the
    script alone. Not given: the agent's own variables (its store, error file and signal list), since
    no agent runs; rank 0 hosts the rendezvous store."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(list(command[3:]))
    with _environment(env, cwd), _warnings_ignored():
        args, defaults, mp_from_config_flag = _validate_launch_command(args)
        if args.use_deepspeed:
            fields = list(defaults.deepspeed_config.keys()) if defaults else []
            if mp_from_config_flag:
                fields.append("mixed_precision")
            args.deepspeed_fields_from_accelerate_config = ",".join(fields)
            _, current = prepare_deepspeed_cmd_env(args)
            # what the launcher's `import deepspeed` sets in its environment, which the ranks inherit
            current.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        elif args.multi_gpu:
            current = prepare_multi_gpu_env(args)
        else:  # the simple launcher: one plain process, no rank variables
            return [dict(env)]
    world = int(args.num_processes)
    port = str(args.main_process_port)
    ranks = []
    for rank in range(world):
        ranks.append(
            {
                **current,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "GROUP_RANK": "0",
                "ROLE_RANK": str(rank),
                "ROLE_NAME": "default",
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world),
                "ROLE_WORLD_SIZE": str(world),
                "GROUP_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "0",
                "TORCHELASTIC_RUN_ID": "none",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            }
        )
    return ranks


@contextlib.contextmanager
def _warnings_ignored():
    """accelerate's launch checks warn about a machine without GPUs; not this launch's business."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _forked_launch(
    script: Path, args: Sequence[str], command: list[str], env: dict[str, str], cwd: str, timeout: float
) -> tuple[int | None, str, str, bool]:
    """Start the ranks of ``command`` as forks of the preloaded server (tests/forked.py) with the
    environments of :func:`rank_environments`, wait for all, and, as torch's elastic agent does, stop the
    others (SIGTERM, then SIGKILL after 30 s) once one fails. Returns (exit status: 0, or the first
    failing rank's; None after a timeout), stdout, stderr (the ranks' one after the other), timed out."""
    import tempfile

    import forked

    with tempfile.TemporaryDirectory(prefix="ranks-") as folder:
        environments = rank_environments(command, env, cwd)
        logs = [
            [os.path.join(folder, f"{rank}.{name}") for name in ("out", "err")]
            for rank in range(len(environments))
        ]
        processes = [
            forked.start(script, args, cwd=cwd, env=rank_env, logs=logs[rank])
            for rank, rank_env in enumerate(environments)
        ]
        deadline = time.monotonic() + timeout
        failed: int | None = None
        stop_at: float | None = None
        timed_out = False
        while any(p.exitcode is None for p in processes):
            time.sleep(0.1)
            now = time.monotonic()
            if failed is None:
                failed = next((p.exitcode for p in processes if p.exitcode not in (None, 0)), None)
                if failed is not None:
                    for p in processes:
                        if p.exitcode is None:
                            p.terminate()
                    stop_at = now + 30
            if now > deadline or (stop_at is not None and now > stop_at):
                timed_out = failed is None
                for p in processes:
                    if p.exitcode is None:
                        p.kill()
                for p in processes:
                    p.join()
        for p in processes:
            p.join()
        out, err = (
            "".join(
                Path(logs[rank][i]).read_text(errors="replace") if os.path.exists(logs[rank][i]) else ""
                for rank in range(len(processes))
            )
            for i in (0, 1)
        )
    if timed_out:
        return None, out, err, True
    if failed is None:
        failed = next((p.exitcode for p in processes if p.exitcode), 0)
    return failed, out, err, False


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
    launcher: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `script` with `args` on `num_processes` CPU ranks (gloo), as ``accelerate launch`` starts them.

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
        launcher: ``"accelerate"``: the :func:`launch_command` line itself (the launcher process, torch's
            elastic agent, each rank a fresh interpreter). ``"forked"`` (the default, or
            ``$RLHF_TESTS_LAUNCHER``): the same ranks with the same environments
            (:func:`rank_environments`, computed by accelerate's own launch code), each started as a
            fork of tests/forked.py's preloaded server, ~5 s of imports less per rank and no launcher
            process; they end through ``atexit`` and ``os._exit`` rather than an interpreter shutdown,
            so tests of what happens at exit (tests/test_distributed_exit.py) and of the launcher itself
            use ``"accelerate"``.

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
    launcher = launcher or _default_launcher()
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher={launcher!r}: must be one of {LAUNCHERS}.")
    if deepspeed is not None:
        clear_stale_build_locks()
    started = time.perf_counter()
    if launcher == "forked":
        returncode, stdout, stderr, timed_out = _forked_launch(
            path, [str(a) for a in args], command, launch_env(env), str(cwd or REPO_ROOT), timeout
        )
    else:
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
        returncode = process.returncode
    seconds = time.perf_counter() - started
    completed = subprocess.CompletedProcess(command, returncode, stdout, stderr)
    completed.seconds = seconds  # type: ignore[attr-defined]
    completed.launcher = launcher  # type: ignore[attr-defined]
    if timed_out or returncode != 0:
        what = f"timed out after {timeout:.0f} s" if timed_out else f"exited with {returncode}"
        raise AssertionError(
            f"{path.name} on {num_processes} process(es), deepspeed={deepspeed!r}, {launcher} launch: {what} "
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


# --------------------------------------------------------------------------------------------------
# On-policy trainers (PPO, RLOO): what tests/scripts/{ppo,rloo}_distributed.py and their tests share
# --------------------------------------------------------------------------------------------------

#: The three launch modes of the on-policy tests, as ``pytest.mark.parametrize`` values of `deepspeed`.
ONPOLICY_MODES = [
    pytest.param(None, id="ddp"),
    pytest.param("zero2", id="zero2", marks=[pytest.mark.deepspeed, requires_deepspeed]),
    pytest.param("zero3", id="zero3", marks=[pytest.mark.deepspeed, requires_deepspeed]),
]


def onpolicy_parser(description: str) -> argparse.ArgumentParser:
    """The command line every on-policy test script takes; a script adds its own options, then calls
    :func:`parse_onpolicy_args`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=20)
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=2e-3)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--num_eval_prompts", type=int, default=64)
    parser.add_argument("--save_steps", type=int, default=0, help="checkpoint every N updates (0: none)")
    parser.add_argument("--save_model", action="store_true", help="trainer.save_model(<output_dir>/final)")
    parser.add_argument("--resume_from_checkpoint", default=None, help="train(resume_from_checkpoint=...)")
    parser.add_argument(
        "--save_on_each_node", action="store_true", help="TrainingArguments.save_on_each_node"
    )
    parser.add_argument(
        "--no_gather_for_generation", action="store_true", help="ds3_gather_for_generation=False"
    )
    parser.add_argument(
        "--sigterm_during_update",
        type=int,
        default=0,
        help="the last rank sends itself SIGTERM in the middle of update N (from inside its first policy "
        "loss of that update); every rank must stop after update N with its checkpoint written; 0: never",
    )
    parser.add_argument(
        "--dump_stacks_after",
        type=float,
        default=0,
        help="seconds after which every rank prints its Python stacks and exits (a deadlock shows where the "
        "ranks wait instead of running into the test's timeout); 0: never",
    )
    return parser


def parse_onpolicy_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse the command line and start the ``--dump_stacks_after`` watchdog."""
    cli = parser.parse_args()
    if cli.dump_stacks_after:
        faulthandler.dump_traceback_later(cli.dump_stacks_after, exit=True)
    return cli


def onpolicy_config_kwargs(cli: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~rlhf_trainers.OnPolicyConfig` fields both scripts use: the kit's task (12-token
    completions, temperature 1), 2 epochs x 2 mini-batches per update, a log entry per update, no
    evaluation or sample tables during training, seed 0, CPU."""
    return {
        "output_dir": cli.output_dir,
        "learning_rate": cli.learning_rate,
        "per_device_train_batch_size": cli.per_device_train_batch_size,
        "gradient_accumulation_steps": cli.gradient_accumulation_steps,
        "num_mini_batches": 2,
        "num_ppo_epochs": 2,
        "response_length": 12,
        "temperature": 1.0,
        "kl_coef": 0.05,
        "max_steps": cli.max_steps,
        "logging_steps": 1,
        "eval_strategy": "no",
        "save_strategy": "steps" if cli.save_steps else "no",
        "save_steps": cli.save_steps or 500,
        "save_on_each_node": cli.save_on_each_node,
        "report_to": "none",
        "disable_tqdm": True,
        "num_sample_generations": 0,
        "seed": 0,
        "use_cpu": True,
        "ds3_gather_for_generation": not cli.no_gather_for_generation,
    }


class CountUpdates(TrainerCallback):
    """Counts the updates this launch ran (a resumed run starts at the checkpoint's step)."""

    def __init__(self) -> None:
        self.updates = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.updates += 1


def train_and_report(
    trainer: Trainer, cli: argparse.Namespace, models: Mapping[str, str], logs: Mapping[str, str]
) -> dict[str, Any]:
    """Evaluate, train (resuming from ``cli.resume_from_checkpoint``), evaluate, save the model if
    ``cli.save_model``, and return what every on-policy script reports.

    Args:
        trainer: the on-policy trainer, built on every rank.
        cli: the parsed :func:`onpolicy_parser` command line.
        models: result-key prefix -> trainer attribute of a model to digest before and after training
            (e.g. ``{"policy": "policy"}``): ``<prefix>_before``, ``<prefix>_digest``, ``<prefix>_numel``.
        logs: result key -> metric name: the metric's value at every logged update, as a list.

    Returns:
        the digests and logs above, ``metrics_before``/``metrics`` (eval before and after),
        ``world_size``, ``torch_world_size``, ``distributed_type``, ``zero_stage``, ``global_step``,
        ``updates_run`` (by this launch), ``interrupted`` (``train()`` stopped on a signal),
        ``train_seconds`` and ``file_syncs`` (this rank's ``os.fsync``/``os.replace`` calls during
        ``train()``, see tests/file_syncs.py; empty where they cannot be recorded). Every step is a
        collective under ZeRO-3: call it on every rank.
    """
    import torch

    counter = CountUpdates()
    trainer.add_callback(counter)
    if getattr(cli, "sigterm_during_update", 0):
        _send_sigterm_during_update(trainer, cli.sigterm_during_update)
    result: dict[str, Any] = {
        f"{p}_before": parameter_digest(getattr(trainer, a))[0] for p, a in models.items()
    }
    result["metrics_before"] = trainer.evaluate()
    started = time.perf_counter()
    with record_file_syncs() if can_record() else contextlib.nullcontext([]) as file_syncs:
        trainer.train(resume_from_checkpoint=cli.resume_from_checkpoint)
    result["train_seconds"] = time.perf_counter() - started
    result["file_syncs"] = file_syncs
    result["metrics"] = trainer.evaluate()
    if cli.save_model:
        trainer.save_model(f"{cli.output_dir}/final")
    for prefix, attribute in models.items():
        result[f"{prefix}_digest"], result[f"{prefix}_numel"] = parameter_digest(getattr(trainer, attribute))
    history = [log for log in trainer.state.log_history if "objective/scores" in log]
    result.update({key: [log[name] for log in history] for key, name in logs.items()})
    state = trainer.accelerator.state
    result.update(
        world_size=state.num_processes,
        torch_world_size=torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
        distributed_type=str(state.distributed_type),
        zero_stage=state.deepspeed_plugin.zero_stage if state.deepspeed_plugin else None,
        global_step=trainer.state.global_step,
        updates_run=counter.updates,
        interrupted=trainer.interrupted,
    )
    return result


def _send_sigterm_during_update(trainer: Trainer, update: int) -> None:
    """Make the last rank send itself SIGTERM once, from inside the first policy loss of `update` (as a
    scheduler's preemption would arrive in the middle of an update), and no other rank."""
    import signal

    accelerator = trainer.accelerator
    if accelerator.process_index != accelerator.num_processes - 1:
        return
    compute = trainer.compute_policy_loss
    sent = False

    def signalling(*args: Any, **kwargs: Any) -> Any:
        nonlocal sent
        if not sent and trainer.state.global_step == update - 1:  # global_step counts finished updates
            sent = True
            os.kill(os.getpid(), signal.SIGTERM)
        return compute(*args, **kwargs)

    trainer.compute_policy_loss = signalling


@dataclass
class Run:
    """One launch: its output folder and the results of its ranks (in rank order)."""

    out: Path
    results: list[dict[str, Any]]

    @property
    def rank0(self) -> dict[str, Any]:
        return self.results[0]


class OnPolicyRuns:
    """Launches of an on-policy script on 2 ranks, with the trained runs (``updates`` updates, a checkpoint
    every ``save_steps``, ``save_model()`` to ``<out>/final``) launched on first use and cached, so the
    tests of a module share them.

    Args:
        script: the script in ``tests/scripts/``.
        kit: the offline kit (built by the pytest process, so the ranks never race to build it).
        root: where the cached runs write (``<root>/<mode>``).
        updates, save_steps: of the trained runs.
        dump_stacks_after: a deadlocked launch prints every rank's stacks and exits after this long,
            before the launch timeout.
    """

    def __init__(
        self,
        script: str,
        kit: OfflineKit,
        root: Path,
        *,
        updates: int = 20,
        save_steps: int = 10,
        dump_stacks_after: float = 420,
        timeout: float = 600,
    ) -> None:
        self.script, self.kit, self.root = script, kit, root
        self.updates, self.save_steps = updates, save_steps
        self.dump_stacks_after, self.timeout = dump_stacks_after, timeout
        self.cache: dict[str, Run] = {}

    def launch(self, out: Path, deepspeed: str | None, *args: str, num_processes: int = 2) -> Run:
        """Run the script for ``updates`` updates with `args` and read the results of every rank."""
        run_script(
            self.script,
            [
                "--output_dir",
                str(out),
                "--max_steps",
                str(self.updates),
                "--dump_stacks_after",
                str(self.dump_stacks_after),
                *args,
            ],
            num_processes=num_processes,
            deepspeed=deepspeed,
            env={"RLHF_TRAINERS_KIT_DIR": str(self.kit.root)},
            timeout=self.timeout,
        )
        return Run(out, read_rank_results(out, num_processes))

    def trained(self, deepspeed: str | None) -> Run:
        """The cached trained run of a mode (None: DDP)."""
        key = deepspeed or "ddp"
        if key not in self.cache:
            self.cache[key] = self.launch(
                self.root / key, deepspeed, "--save_steps", str(self.save_steps), "--save_model"
            )
        return self.cache[key]


def check_launch(results: Sequence[Mapping[str, Any]], deepspeed: str | None, updates: int) -> None:
    """Both ranks ran in the expected distributed mode (DDP over gloo, or DeepSpeed at the expected ZeRO
    stage) and reached update `updates`."""
    for r in results:
        assert r["torch_world_size"] == 2
        expected = "DistributedType.DEEPSPEED" if deepspeed else "DistributedType.MULTI_CPU"
        assert r["distributed_type"] == expected
        assert r["zero_stage"] == {None: None, "zero2": 2, "zero3": 3}[deepspeed]
        assert r["global_step"] == updates


def check_first_update_like_ddp(rank0: Mapping[str, Any], ddp: Mapping[str, Any], loss: str) -> None:
    """DeepSpeed's first update is DDP's: the same samples (same weights and seeds, so exactly the same
    scores), the same `loss` (a logged list) and gradient norm up to the order of the reductions; and
    the same learning rate at every update."""
    assert rank0["scores"][0] == ddp["scores"][0]
    assert rank0[loss][0] == pytest.approx(ddp[loss][0], rel=1e-4)
    assert rank0["grad_norm"][0] == pytest.approx(ddp["grad_norm"][0], rel=1e-4)
    # The learning-rate schedule advances once per update under DeepSpeed too (not once per optimizer
    # step, as it would if the engine stepped it).
    assert rank0["lr"] == pytest.approx(ddp["lr"], rel=1e-6), (rank0["lr"], ddp["lr"])


def check_saved_policy(folder: Path, rank0: Mapping[str, Any]) -> None:
    """`folder` holds the run's final policy as full fp32 tensors, loadable with from_pretrained."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(folder)
    assert parameter_digest(policy) == (rank0["policy_digest"], rank0["policy_numel"])
    # full tensors (fp32), not ZeRO-3 shards
    assert (folder / "model.safetensors").stat().st_size > 4 * rank0["policy_numel"]


def check_resume(
    runs: OnPolicyRuns, deepspeed: str | None, out: Path, digests: Sequence[str] = ("policy_digest",)
) -> list[dict[str, Any]]:
    """Resume from the middle checkpoint of the trained run of `deepspeed` into `out`; the resumed run
    must run only the remaining updates and end bitwise like the uninterrupted one (the `digests`
    keys), logging the same scores after the checkpoint. Returns the resumed run's results."""
    uninterrupted = runs.trained(deepspeed)
    checkpoint = uninterrupted.out / f"checkpoint-{runs.save_steps}"
    # 8 eval prompts instead of 64: a resumed launch restores the RNG after its evaluation, so the size of
    # the evaluation does not change what it trains (and its metrics are not compared)
    small_eval = ("--num_eval_prompts", "8")
    results = runs.launch(out, deepspeed, "--resume_from_checkpoint", str(checkpoint), *small_eval).results
    for r in results:
        assert r["global_step"] == runs.updates
        assert r["updates_run"] == runs.updates - runs.save_steps
        # weights, optimizer state, scheduler, RNG and prompt order all restored: bitwise the same run
        for key in digests:
            assert r[key] == uninterrupted.rank0[key], key
    assert results[0]["scores"][runs.save_steps :] == uninterrupted.rank0["scores"][runs.save_steps :]
    return results
