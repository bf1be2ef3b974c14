"""The combiner of the on-policy trainers' reward sources (:class:`RewardSources`): a reward model and any
number of reward functions or other sources, each giving one float per completion, weighted into one
reward; and TRL's ``reward_funcs`` convention (a reward model inside the list) as our arguments
(:func:`split_reward_funcs`)."""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..data.common import Prompt
from .base import RewardBatch, RewardLog, RewardSource, is_reward_source
from .functions import REWARD_ERROR_MODES, REWARD_FUNC_ARGS, RewardFunc, RewardFunctionSource, run_coroutine
from .model import RewardModelSource

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["RewardSources", "split_reward_funcs"]


def _unique_names(names: Sequence[str]) -> list[str]:
    """``names`` made unique in order: the first keeps its name, later ones get ``_2``, ``_3``, ..."""
    used: set[str] = set()
    out = []
    for name in names:
        candidate, n = name, 1
        while candidate in used:
            n += 1
            candidate = f"{name}_{n}"
        used.add(candidate)
        out.append(candidate)
    return out


def names_a_model(value: Any) -> bool:
    """A path or Hub id in ``reward_funcs``: an existing folder, a string spelled as a path (``./rm``,
    ``/data/rm``, ``~/rm``, ``a/b/c``), or a string of the ``owner/name`` form. Other strings stay where
    they are and are refused as not callable, with the reward sources' message (e.g. a function's name
    given instead of the function)."""
    from ..model_paths import looks_like_local_path

    if isinstance(value, os.PathLike):
        return True
    return isinstance(value, str) and (
        os.path.isdir(value) or value.count("/") == 1 or looks_like_local_path(value)
    )


def split_reward_funcs(
    reward_funcs: Any,
    reward_processing_classes: Any,
    reward_weights: list[float] | None,
) -> tuple[Any, list[Callable[..., Any]], Any, list[float] | None]:
    """TRL's ``reward_funcs`` (a function, a reward model, or its folder or Hub id ``owner/name``, or a list
    mixing them) as the engine's ``(reward_model, reward_funcs, reward_processing_class, reward_weights)``: at most one
    reward model, moved to the front of the weights (the engine's order: reward model first)."""
    from transformers import PreTrainedModel

    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if not funcs or any(f is None for f in funcs):
        raise ValueError(
            "reward_funcs must be a function f(prompts, completions, **columns) -> list[float], a "
            "one-label sequence-classification model (or its path), or a list of them."
        )
    tokenizers = (
        list(reward_processing_classes)
        if isinstance(reward_processing_classes, (list, tuple))
        else [reward_processing_classes] * len(funcs)
    )
    if len(tokenizers) != len(funcs):
        raise ValueError(
            f"reward_processing_classes has {len(tokenizers)} entries for {len(funcs)} reward_funcs; give one "
            "per reward function (None for plain functions)."
        )
    models = [i for i, f in enumerate(funcs) if isinstance(f, PreTrainedModel) or names_a_model(f)]
    if len(models) > 1:
        raise ValueError(
            f"reward_funcs holds {len(models)} reward models (positions {models}); the trainers take at most "
            "one reward model next to any number of reward functions. Combine the models in a function, "
            "or train with one of them."
        )
    # Entries that are neither a model nor callable are refused by RewardSources, naming their index.
    if reward_weights is not None and len(reward_weights) != len(funcs):
        raise ValueError(
            f"reward_weights has {len(reward_weights)} values for {len(funcs)} reward_funcs; give one weight "
            "per reward function, in the same order."
        )
    if not models:
        return None, funcs, None, reward_weights
    index = models[0]
    functions = [f for i, f in enumerate(funcs) if i != index]
    weights = None
    if reward_weights is not None:
        weights = [reward_weights[index]] + [w for i, w in enumerate(reward_weights) if i != index]
    return funcs[index], functions, tokenizers[index], weights


class RewardSources:
    """The rewards of a rollout batch: a reward model and/or reward functions and other
    :class:`~rlhf_trainers.rewards.RewardSource` objects, weighted.

    The on-policy trainers call it once per rollout batch. Each source gives one float per sequence;
    the total is ``sum(weight * source)`` over the sources that gave the row a number, as TRL's
    ``nansum``. The reward model becomes a :class:`~rlhf_trainers.rewards.RewardModelSource` (the policy's
    ids when it shares the policy's tokenizer, the re-tokenized text otherwise), each plain function a
    :class:`~rlhf_trainers.rewards.RewardFunctionSource` (called as TRL 1.16 calls reward functions), and
    an entry of ``reward_funcs`` that already is a source (a ``name`` and a ``score(batch)`` method) is
    used as it is. Synchronous sources score first, in order; then the asynchronous ones (``async def``
    functions) run concurrently on one event loop.

    NaN (a function's ``None``, a non-finite value) means "this source does not score this row": it is
    left out of that row's sum. A row's ``total`` is NaN, and the caller leaves the row out of the update,
    when no source scored it, or when a source that reported errors (``last_errors``, e.g. a function
    skipped with ``on_error="skip"``) gave it NaN.

    Args:
        policy_tokenizer: the policy's tokenizer; its pad id pads ``query_response_ids``.
        reward_model: a one-label sequence-classification model (or None).
        reward_tokenizer: the reward model's tokenizer; None means the policy's.
        reward_funcs: one reward function or source, or a sequence of them (or None).
        reward_weights: one finite weight per source (reward model first, then ``reward_funcs`` in
            order); default 1.0 each.
        batch_size: rows per reward-model forward pass.
        max_length: if given, the reward model sees at most the last ``max_length`` tokens of each
            sequence (its end, where the score is read).
        on_error: ``"raise"`` (default) or ``"skip"``: what a failing reward function does
            (:class:`~rlhf_trainers.rewards.RewardFunctionSource`).
        padding_free: score with the real tokens packed, when the reward model allows it
            (:class:`~rlhf_trainers.rewards.RewardModelSource`).

    Attributes:
        sources: the sources, in the order of ``names``.
        last_errors: rows of the last call that a source could not score (the sum of the sources'
            ``last_errors``; a reward function's with ``on_error="skip"``).
        last_log: what the reward functions logged in the last call (``log_metric``, ``log_extra``).
        names: one per source: ``"reward_model"`` first when there is one, then each entry's name (a
            function's ``__name__``), made unique (``name``, ``name_2``, ...).
        weights: one float per source, in the order of ``names``.
        same_tokenizer: whether the reward model scores the policy's token ids directly (True without a
            reward model).
        model_source: the reward model's source, or None.

    Raises:
        ValueError: no source; a reward model that is not a one-label sequence-classification model; a
            reward tokenizer (or, with the policy's ids, a policy tokenizer) without a pad token; a
            reward tokenizer without a reward model; weights of the wrong number or not finite; a
            ``batch_size`` or ``max_length`` below 1.
        TypeError: a reward function that is not callable or cannot take ``prompts=`` and
            ``completions=`` as keyword arguments.
    """

    def __init__(
        self,
        *,
        policy_tokenizer: PreTrainedTokenizerBase,
        reward_model: PreTrainedModel | None = None,
        reward_tokenizer: PreTrainedTokenizerBase | None = None,
        reward_funcs: Sequence[RewardFunc | RewardSource] | RewardFunc | RewardSource | None = None,
        reward_weights: Sequence[float] | None = None,
        batch_size: int = 64,
        max_length: int | None = None,
        on_error: str = "raise",
        padding_free: bool = False,
    ) -> None:
        if on_error not in REWARD_ERROR_MODES:
            raise ValueError(f"on_error must be one of {REWARD_ERROR_MODES}, got {on_error!r}.")
        self.on_error = on_error
        self.last_errors = 0
        self.last_log = RewardLog()
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}.")
        if max_length is not None and (
            isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1
        ):
            raise ValueError(f"max_length must be None or an integer >= 1, got {max_length!r}.")
        entries = self._as_entry_list(reward_funcs)
        if reward_model is None and not entries:
            raise ValueError(
                "No reward source: got reward_model=None and no reward_funcs. Pass a reward model "
                "(reward_model=...), one or more reward functions (reward_funcs=[f, ...]), or both."
            )
        if reward_model is None and reward_tokenizer is not None:
            raise ValueError(
                "reward_tokenizer was given without a reward_model; it is only used to score with a reward "
                "model. Pass reward_model=... as well, or drop reward_tokenizer."
            )
        others: list[RewardSource] = [
            entry if is_reward_source(entry) else RewardFunctionSource(entry, on_error=on_error, index=i)
            for i, entry in enumerate(entries)
        ]
        self.policy_tokenizer = policy_tokenizer
        self.reward_model = reward_model
        self.reward_tokenizer = reward_tokenizer
        self.batch_size = batch_size
        self.max_length = max_length
        self.padding_free = padding_free
        self.model_source: RewardModelSource | None = None
        if reward_model is not None:
            self.model_source = RewardModelSource(
                reward_model,
                policy_tokenizer=policy_tokenizer,
                reward_tokenizer=reward_tokenizer,
                batch_size=batch_size,
                max_length=max_length,
                padding_free=padding_free,
            )
        self.same_tokenizer: bool = self.model_source is None or self.model_source.same_tokenizer
        self.sources: list[RewardSource] = ([self.model_source] if self.model_source else []) + others
        self.names: list[str] = _unique_names([source.name for source in self.sources])
        wrapped = {id(source) for source, entry in zip(others, entries, strict=True) if source is not entry}
        for source, name in zip(self.sources, self.names, strict=True):
            if id(source) in wrapped:
                source.name = name  # a function wrapped here: its messages name it as its metric does
        self.weights: list[float] = self._check_weights(reward_weights, self.names)

    @staticmethod
    def _as_entry_list(
        reward_funcs: Sequence[RewardFunc | RewardSource] | RewardFunc | RewardSource | None,
    ) -> list[Any]:
        if reward_funcs is None:
            return []
        if callable(reward_funcs) or is_reward_source(reward_funcs):
            return [reward_funcs]
        if isinstance(reward_funcs, (str, bytes)) or not isinstance(reward_funcs, Sequence):
            raise TypeError(
                "reward_funcs must be a callable or a list of callables f(prompts, completions, **kwargs) "
                f"(or reward sources), got {type(reward_funcs).__name__}: {reward_funcs!r}."
            )
        return list(reward_funcs)

    @staticmethod
    def _check_weights(reward_weights: Sequence[float] | None, names: list[str]) -> list[float]:
        if reward_weights is None:
            return [1.0] * len(names)
        if isinstance(reward_weights, (str, bytes)) or not isinstance(reward_weights, Sequence):
            raise ValueError(
                f"reward_weights must be a list of {len(names)} floats (one per source: {names}), got "
                f"{type(reward_weights).__name__}: {reward_weights!r}."
            )
        if len(reward_weights) != len(names):
            raise ValueError(
                f"reward_weights has {len(reward_weights)} values but there are {len(names)} reward "
                f"sources {names} (the reward model first, then the functions); give one weight per "
                "source, or none for 1.0 each."
            )
        weights = []
        for name, weight in zip(names, reward_weights, strict=True):
            try:
                value = float(weight) if not isinstance(weight, (str, bytes)) else math.nan
            except (TypeError, ValueError):
                value = math.nan
            if not math.isfinite(value):
                raise ValueError(
                    f"reward_weights must be finite floats; the weight of {name!r} is {weight!r}. Use 0.0 "
                    "to log a source without it counting in the reward."
                )
            weights.append(value)
        return weights

    @property
    def may_log(self) -> bool:
        """Whether a source can log metrics or columns (a reward function that takes ``log_metric``,
        ``log_extra`` or ``**kwargs``; a source of one's own may write to ``batch.log`` too, so any source
        that is not a reward function or the reward model counts). The same on every process."""
        for source in self.sources:
            if source is self.model_source:
                continue
            if not isinstance(source, RewardFunctionSource) or source.may_log:
                return True
        return False

    def __repr__(self) -> str:
        sources = ", ".join(f"{n}={w:g}" for n, w in zip(self.names, self.weights, strict=True))
        return f"{type(self).__name__}({sources}, same_tokenizer={self.same_tokenizer})"

    def __call__(
        self,
        *,
        query_response_ids: torch.Tensor,
        prompts: Sequence[Prompt],
        completions: Sequence[str],
        columns: Mapping[str, Sequence[Any]] | None = None,
        reward_model_forward: Callable[..., Any] | None = None,
        prompt_width: int | None = None,
        completion_lengths: Sequence[int] | torch.Tensor | None = None,
        trainer_state: Any = None,
        conversations: Sequence[list[dict[str, Any]]] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Score a rollout batch with every source.

        Args:
            query_response_ids: (B, T) left-padded prompt ids followed by the response ids, the response
                right-padded after it stops; both paddings use the policy tokenizer's pad id.
            prompts: the B prompts as in the dataset (strings or lists of ``{"role", "content"}``).
            completions: the B decoded responses (special tokens skipped); reward functions receive them
                as assistant messages when the prompts are conversational.
            columns: the other dataset columns of these rows, each a sequence of length B, passed to
                the reward functions as keyword arguments.
            reward_model_forward: replaces ``reward_model.__call__`` (e.g. a DeepSpeed engine).
            prompt_width: the columns of ``query_response_ids`` that hold the prompts (for sources that
                read :attr:`~rlhf_trainers.rewards.RewardBatch.completion_ids`, and the reward functions'
                ``completion_ids``).
            completion_lengths: B response lengths in tokens (the stop token included), which cut the
                reward functions' ``completion_ids``; None: each row's trailing pad ids are cut instead.
            trainer_state: the reward functions' ``trainer_state`` (the trainer's ``TrainerState``).
            conversations: a multi-turn rollout's completions as messages (assistant turns and tool
                results), which reward functions receive as ``completions`` for conversational prompts.

        Returns:
            ``(total, per_source)``: ``per_source[name]`` a float32 (B,) CPU tensor per source (in the
            order of ``names``, NaN where a function gave None or a non-finite value), and ``total``, the
            sum of ``weight * per_source[name]`` over the sources that scored the row (NaN where none did,
            or where a failing source left the row unscored). What the functions logged is in
            :attr:`last_log`.

        Raises:
            ValueError: inputs of mismatched lengths; a column named like a fixed argument; a reward
                function missing a column it requires or returning the wrong number of values; a source
                returning something other than B scores.
            TypeError: a reward function returning something other than floats/None.
            RuntimeError: a reward function raised (the original exception is the cause).
        """
        prompts, completions = list(prompts), list(completions)
        rows = len(prompts)
        self._check_batch(query_response_ids, completions, columns, rows)
        if isinstance(completion_lengths, torch.Tensor):
            completion_lengths = completion_lengths.tolist()
        if completion_lengths is not None and len(completion_lengths) != rows:
            raise ValueError(
                f"completion_lengths has {len(completion_lengths)} values for a batch of {rows}; give one per row."
            )
        log = RewardLog()
        batch = RewardBatch(
            prompts=prompts,
            completions=completions,
            query_response_ids=query_response_ids,
            pad_token_id=self.policy_tokenizer.pad_token_id,
            prompt_width=prompt_width,
            columns=dict(columns or {}),
            reward_model_forward=reward_model_forward,
            completion_lengths=completion_lengths,
            trainer_state=trainer_state,
            log=log,
            conversations=None if conversations is None else list(conversations),
        )
        self.last_log = log
        for source in self.sources:
            check = getattr(source, "check", None)
            if callable(check):
                check(batch)
        self.last_errors = 0
        results = self._scores_of_every_source(batch)
        per_source: dict[str, torch.Tensor] = {}
        failed = torch.zeros(rows, dtype=torch.bool)
        scored = torch.zeros(rows, dtype=torch.bool)
        for source, name in zip(self.sources, self.names, strict=True):
            per_source[name] = _scores(results[name], name, rows)
            errors = int(getattr(source, "last_errors", 0) or 0)
            self.last_errors += errors
            missing = per_source[name].isnan()
            scored |= ~missing
            if errors:
                failed |= missing
        total = torch.zeros(rows, dtype=torch.float32)
        for name, weight in zip(self.names, self.weights, strict=True):
            weighted = weight * per_source[name]
            total = total + torch.where(weighted.isnan(), torch.zeros_like(weighted), weighted)
        total[failed | ~scored] = math.nan
        return total, per_source

    def _scores_of_every_source(self, batch: RewardBatch) -> dict[str, Any]:
        """Each source's raw scores of ``batch``, by name: the sync sources in order, then every async
        source at once (``asyncio.gather``)."""
        results: dict[str, Any] = {}
        concurrent = []
        for source, name in zip(self.sources, self.names, strict=True):
            if getattr(source, "is_async", False) and callable(getattr(source, "ascore", None)):
                concurrent.append((source, name))
            else:
                results[name] = source.score(batch)
        if concurrent:

            async def score_concurrently() -> list[Any]:
                return await asyncio.gather(*(source.ascore(batch) for source, _ in concurrent))

            for (_, name), values in zip(concurrent, run_coroutine(score_concurrently()), strict=True):
                results[name] = values
        return results

    @staticmethod
    def _check_batch(
        query_response_ids: torch.Tensor,
        completions: list[str],
        columns: Mapping[str, Sequence[Any]] | None,
        batch: int,
    ) -> None:
        if len(completions) != batch:
            raise ValueError(
                f"got {batch} prompts but {len(completions)} completions; give one completion per prompt."
            )
        if not isinstance(query_response_ids, torch.Tensor) or query_response_ids.dim() != 2:
            shape = tuple(query_response_ids.shape) if isinstance(query_response_ids, torch.Tensor) else None
            raise ValueError(
                f"query_response_ids must be a (batch, length) tensor, got "
                f"{type(query_response_ids).__name__} of shape {shape}."
            )
        if query_response_ids.shape[0] != batch:
            raise ValueError(
                f"query_response_ids has {query_response_ids.shape[0]} rows but there are {batch} prompts; "
                "the rows must be the same sequences, in the same order."
            )
        for key, values in (columns or {}).items():
            if key in REWARD_FUNC_ARGS:
                raise ValueError(
                    f"columns must not contain {key!r}: reward functions get {key}= from the trainer (the "
                    f"arguments it passes: {list(REWARD_FUNC_ARGS)}). Rename that dataset column."
                )
            if len(values) != batch:
                raise ValueError(
                    f"column {key!r} has {len(values)} values for a batch of {batch}; give one per row."
                )


def _scores(values: Any, name: str, rows: int) -> torch.Tensor:
    """A source's scores as a float32 (B,) CPU tensor (the tensor itself when it already is one)."""
    scores = values if isinstance(values, torch.Tensor) else torch.as_tensor(values, dtype=torch.float32)
    if scores.shape != (rows,):
        raise ValueError(
            f"reward source {name!r} returned scores of shape {tuple(scores.shape)} for a batch of {rows} "
            f"completions; a source's score(batch) must return one float per completion, shape ({rows},)."
        )
    return scores.to(device="cpu", dtype=torch.float32)
