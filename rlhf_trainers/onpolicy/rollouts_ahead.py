"""Asynchronous rollouts (``async_rollouts=True``): the responses of update u+1 are generated while update u
trains, with the weights of update u (one update stale, ``max_staleness=1``).

When update u takes its responses (the ones generated ahead, or, for the first update, generated now), the
generation of update u+1's prompts is launched with the weights the policy has then, which update u is
about to change: the servers are synced first (on this thread, while nothing else runs on them), then the
requests go out from a background thread, and update u trains meanwhile. The background thread only waits
on HTTP: it runs no collective and no forward pass, and draws no random number (the requests' seeds come
from a seed drawn here, before the launch). With a colocated engine (in this process) nothing can overlap:
the generation of update u+1 runs at the launch, with the same weights and seeds, so a colocated run
samples what a server run samples (the tests rely on it).

The responses generated ahead are the *behaviour* policy's (the weights of update u); update u+1 scores
them, recomputes their log-probs with its own weights, and trains with the truncated importance-sampling
correction against the behaviour log-probs the servers returned (``vllm_importance_sampling_*``), as
every vLLM run does; ``rollout/staleness`` logs how many updates behind the behaviour weights were.

A checkpoint holds the responses in flight (``rollout_ahead-<process>.pt``: the raw tokens and log-probs,
for the update they belong to), so a resumed run trains on exactly what the interrupted one would have.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ..generation import Samples

__all__ = ["AHEAD_FILE", "RolloutsAhead", "rollouts_ahead"]

#: The checkpoint file of a process's responses in flight (``{process}`` is its index).
AHEAD_FILE = "rollout_ahead-{process}.pt"


def rollouts_ahead(engine: Any) -> RolloutsAhead | None:
    """The on-policy trainer ``engine``'s generation one update ahead (``async_rollouts``), else None."""
    return getattr(getattr(engine, "producer", None), "ahead", None)


@dataclass
class _Launched:
    """The generation of one update's responses, launched ahead."""

    update: int
    #: The raw samples (done), or their future (in flight on the background thread).
    result: Samples | Future[Samples]
    #: Updates between the weights that generated them and the update that trains on them.
    staleness: int
    #: What they were sampled with (None after a resume: only their shape is checked then).
    settings: Any = None


class RolloutsAhead:
    """The single-turn producer's generation, one update ahead (see the module).

    Args:
        producer: the :class:`~rlhf_trainers.onpolicy.producer.SingleTurnProducer` whose prompts and
            post-processing are used.
        engine: the on-policy trainer (its sampler, backend, state and config).
    """

    def __init__(self, producer: Any, engine: Any) -> None:
        self.producer = producer
        self.engine = engine
        backend = engine.sampler.backend
        #: Whether the backend generates outside this process (a server): only then does generation overlap.
        self.overlaps = bool(getattr(backend, "generates_elsewhere", False))
        self._pool = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollouts-ahead") if self.overlaps else None
        )
        self._launched: _Launched | None = None

    # ---- the producer's side --------------------------------------------------------------------

    def samples(
        self, update: int, batch: dict[str, Any], copies: int, with_logprobs: bool, timings: dict[str, float]
    ) -> Any:
        """The :class:`~rlhf_trainers.onpolicy.rollout.SampledResponses` of update ``update`` (the ones
        launched ahead, else generated now), after launching the generation of update ``update + 1``."""
        launched, self._launched = self._launched, None
        if launched is not None and launched.update != update:
            launched = None  # launched for another update (a run restarted elsewhere): generated anew
        if launched is None:
            samples = self.producer.sample(batch, copies, with_logprobs, timings)
            staleness = 0
        else:
            settings = launched.settings or self.engine.sampler.settings(with_logprobs)
            rows = batch["input_ids"].shape[0] * copies
            generated, extras = self.engine.sampler.shared_result(
                lambda: self._wait(launched, timings), rows, settings
            )
            samples = self.producer.samples_from(batch, copies, generated, extras)
            staleness = launched.staleness
        samples.extra_metrics = {**(samples.extra_metrics or {}), "rollout/staleness": [float(staleness)]}
        if update + 1 < self.engine.num_updates:
            self._launch(update + 1, copies, with_logprobs, timings)
        return samples

    def _launch(self, update: int, copies: int, with_logprobs: bool, timings: dict[str, float]) -> None:
        """Start generating update ``update``'s responses with the policy's weights as they are now."""
        began = time.perf_counter()
        query, query_mask = self.producer.queries(self.producer.prompt_batch(update), copies)
        seed = int(torch.randint(0, 2**31 - 1, ()).item())  # here, not on the background thread
        settings = self.engine.sampler.settings(with_logprobs, seed=seed)
        backend = self.engine.sampler.backend
        if self.overlaps:
            backend.sync_if_stale()  # this thread: the weights of now, before any request goes out
            future = self._pool.submit(backend.sample, query, query_mask, settings, sync=False)
            self._launched = _Launched(update, future, staleness=1, settings=settings)
        else:  # in this process: generated now, its failure raised when update `update` takes it
            done: Future[Samples] = Future()
            try:
                done.set_result(backend.sample(query, query_mask, settings))
            except Exception as err:
                done.set_exception(err)
            self._launched = _Launched(update, done, staleness=1, settings=settings)
        timings["timing/generate"] += time.perf_counter() - began

    def _wait(self, launched: _Launched, timings: dict[str, float]) -> Samples:
        result = launched.result
        if isinstance(result, Future):
            began = time.perf_counter()
            try:
                result = result.result()
            finally:
                waited = time.perf_counter() - began
                timings["timing/generate_wait"] += waited
                timings["timing/generate"] += waited
        return result

    # ---- around it ------------------------------------------------------------------------------

    def settle(self) -> None:
        """Wait for the generation in flight (before anything else uses the servers from this thread:
        evaluation, a checkpoint), keeping its result."""
        launched = self._launched
        if launched is not None and isinstance(launched.result, Future):
            try:
                launched.result = launched.result.result()
            except Exception:
                self._launched = None  # its update generates anew (and fails there, if it must)

    def save(self, folder: str) -> None:
        """Write the responses in flight (waited for) into the checkpoint ``folder``."""
        self.settle()
        launched = self._launched
        if launched is None:
            return
        raw = launched.result
        assert isinstance(raw, Samples)
        path = os.path.join(folder, AHEAD_FILE.format(process=self.engine.accelerator.process_index))
        torch.save(
            {
                "update": launched.update,
                "staleness": launched.staleness,
                "tokens": raw.tokens.cpu(),
                "logprobs": None if raw.logprobs is None else raw.logprobs.cpu(),
            },
            path,
        )

    def load(self, checkpoint: str) -> None:
        """Take the responses in flight from ``checkpoint`` (if it has them) for the update they belong to."""
        path = os.path.join(checkpoint, AHEAD_FILE.format(process=self.engine.accelerator.process_index))
        if not os.path.isfile(path):
            self._launched = None
            return
        saved = torch.load(path, map_location="cpu", weights_only=True)
        device = self.engine.accelerator.device
        logprobs = saved["logprobs"]
        raw = Samples(saved["tokens"].to(device), None if logprobs is None else logprobs.to(device), None)
        self._launched = _Launched(int(saved["update"]), raw, staleness=int(saved["staleness"]))

    def close(self) -> None:
        """Wait for the generation in flight and stop the background thread."""
        self.settle()
        self._launched = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
