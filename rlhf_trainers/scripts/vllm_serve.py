"""``rlhf-trainers vllm-serve``: start vLLM's own OpenAI-compatible server for a model, with what training
against it needs (``vllm_mode="server"``, docs/generation.md):

- vLLM's RL routes (``VLLM_SERVER_DEV_MODE=1``) and its weight-transfer API with the gloo engine of
  :mod:`rlhf_trainers.generation.weight_transfer` (``--weight-transfer-config '{"backend": "gloo"}'``,
  registered in vLLM's workers by ``--worker-extension-cls``);
- log-probs after the temperature (``--logprobs-mode processed_logprobs``) and no sampling defaults from the
  model's ``generation_config.json`` (``--generation-config vllm``), so the server samples the distribution
  the trainer trains;
- with ``--enable_lora``: LoRA adapters loaded at run time (``vllm_lora_sync="adapter"``);
- on CPU: eager mode, KV blocks of 32 tokens with prefix caching, no chunked prefill (a chunked request's
  seeded generator cannot be rewound on CPU) and ``--kv_cache_space_gib`` of KV cache.

It runs vLLM's server in place of this process (``exec``), so signals and the exit status are vLLM's. The
flags after ``--`` go to vLLM unchanged (e.g. ``-- --max-num-seqs 64``)::

    rlhf-trainers vllm-serve --model Qwen/Qwen2.5-0.5B-Instruct --tensor_parallel_size 2 --port 8000
    rlhf-trainers vllm-serve --model ./my-policy --print_command   # the command only
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Sequence

__all__ = ["main", "server_command"]

#: The worker extension that registers the gloo weight-transfer engine in vLLM's workers.
WORKER_EXTENSION = "rlhf_trainers.generation.weight_transfer.GlooWorkerExtension"


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Start vLLM's server for a model, ready for training with vllm_mode='server'.",
        epilog="Flags after -- are passed to vLLM's server unchanged.",
    )
    parser.add_argument("--model", required=True, help="the model folder or Hub id (the policy's checkpoint)")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument("--tensor_parallel_size", type=int, default=1, help="vLLM's tensor-parallel size")
    parser.add_argument("--data_parallel_size", type=int, default=1, help="vLLM's data-parallel size")
    parser.add_argument(
        "--dtype", default="auto", help="weight dtype: auto (the checkpoint's), float32, bfloat16, float16"
    )
    parser.add_argument("--max_model_len", type=int, default=None, help="context length (prompt + response)")
    parser.add_argument(
        "--gpu_memory_utilization", type=float, default=0.9, help="GPU: the share of device memory vLLM takes"
    )
    parser.add_argument("--kv_cache_space_gib", type=int, default=1, help="CPU: GiB of KV cache (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="the engine's seed (requests carry their own)")
    parser.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda when a GPU is visible"
    )
    parser.add_argument(
        "--enable_lora",
        action="store_true",
        help="serve LoRA adapters loaded at run time, for vllm_lora_sync='adapter' (vLLM's --enable-lora, "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)",
    )
    parser.add_argument(
        "--max_lora_rank",
        type=int,
        default=64,
        help="with --enable_lora: the largest adapter rank r served (one of vLLM's: 8, 16, 32, 64, 128, ...)",
    )
    parser.add_argument("--print_command", action="store_true", help="print the command and its environment")
    return parser


def _on_gpu(device: str) -> bool:
    if device != "auto":
        return device == "cuda"
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:  # pragma: no cover - torch comes with vLLM
        return False


def server_command(args: argparse.Namespace, extra: Sequence[str] = ()) -> tuple[list[str], dict[str, str]]:
    """The command line and the environment variables that start vLLM's server for ``args``."""
    command = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", args.model]
    command += ["--host", args.host, "--port", str(args.port), "--seed", str(args.seed)]
    command += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    command += ["--data-parallel-size", str(args.data_parallel_size), "--dtype", args.dtype]
    command += ["--weight-transfer-config", json.dumps({"backend": "gloo"})]
    command += ["--worker-extension-cls", WORKER_EXTENSION]
    command += ["--logprobs-mode", "processed_logprobs", "--generation-config", "vllm"]
    if args.max_model_len is not None:
        command += ["--max-model-len", str(args.max_model_len)]
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if args.enable_lora:  # one adapter (the policy's), replaced in place at every sync
        command += ["--enable-lora", "--max-lora-rank", str(args.max_lora_rank), "--max-loras", "1"]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    if _on_gpu(args.device):
        command += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    else:
        command += ["--enforce-eager", "--block-size", "32", "--enable-prefix-caching"]
        command += ["--no-enable-chunked-prefill"]
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_space_gib)
    return command + list(extra), env


def main(argv: Sequence[str], prog: str = "rlhf-trainers vllm-serve") -> None:
    """Parse ``argv`` and replace this process with vLLM's server (or print the command)."""
    argv = list(argv)
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    args = _parser(prog).parse_args(argv)
    command, env = server_command(args, extra)
    if args.print_command:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(command))
        return
    try:
        import vllm  # noqa: F401
    except ImportError:
        from ..generation.vllm_colocated import VLLM_INSTALL

        raise SystemExit(
            f"{prog}: vLLM is not installed in this environment ({sys.executable}). {VLLM_INSTALL}."
        ) from None
    os.execve(command[0], command, {**os.environ, **env})
