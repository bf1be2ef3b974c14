"""The rollout producer of ``environment_factory``: tool-calling episodes, each with its own environment
(docs/agents.md, "Environments").

:class:`EnvironmentProducer` is the multi-turn producer
(:class:`~rlhf_trainers.agents.producer.MultiTurnProducer`) with, at the start of each episode, an
environment from the run's :class:`~rlhf_trainers.agents.environments.EnvironmentSet` reset with the
row's columns (``reset(**row)``, TRL's call: the dataset row, ``prompt`` included, without the
``environment`` column of a dict of factories). What ``reset`` returns is appended to the row's prompt,
which is then rendered again (with the tools of that environment only); the episode's tool calls run on
its environment's :class:`~rlhf_trainers.agents.Toolbox`. Reward functions get the rows' environments as
``environments=``, and ``get_reward`` is a reward source of its own.

An environment whose ``reset`` raises does not stop the run (TRL's does): the episode is generated from
the plain prompt, runs no tool, is left out of the update (its reward is None) and counted in
``environments/reset_failure_frequency``; the first failure of a run is logged with its traceback.

What environments draw from Python's ``random`` (and NumPy's global generator) while a rollout is made is
seeded from ``seed``, the update index and the process (in evaluation: the batch's prompts instead of the
update; :func:`~rlhf_trainers.agents.environments.seeded_random`), and creating instances does not
consume it, so a run resumed from a checkpoint re-creates the same episodes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..data.prompts import _PromptTokenizer
from ..onpolicy.rollout import Rollout, SampledResponses, Scores
from .environments import (
    ENVIRONMENT_COLUMN,
    EnvironmentReward,
    EnvironmentSet,
    observed_prompt,
    seeded_random,
)
from .producer import Episode, MultiTurnProducer, _left_padded, check_multi_turn_support, tool_setup
from .tools import Toolbox

logger = logging.getLogger(__name__)

#: The metric of the episodes whose environment's reset() raised (ours; TRL's run stops).
RESET_FAILURES = "environments/reset_failure_frequency"


class EnvironmentProducer(MultiTurnProducer):
    """Tool-calling episodes on environments (see the module docstring).

    Args:
        engine: the trainer.
        environments: the run's environments.
        max_iterations: most tool turns per episode (``max_tool_calling_iterations``).
    """

    def __init__(self, engine: Any, environments: EnvironmentSet, max_iterations: int | None = None) -> None:
        super().__init__(
            engine, Toolbox(environments.standalone, timeout=environments.timeout), max_iterations
        )
        self.environments = environments
        #: The environment of each row of the last :meth:`sample` (what reward functions receive).
        self.current: list[Any] = []
        #: Rows of the last :meth:`sample` whose environment's reset() raised.
        self.failed: set[int] = set()
        self._key: tuple[Any, ...] | None = None
        self._sample_key: tuple[Any, ...] = ()
        self._prompt_column: str | None = "prompt"
        self._warned = False

    # ---- seeding: the rollout of update u draws the same environment randomness on every run ----------

    def produce(self, update: int, timings: dict[str, float], with_values: bool = True) -> Rollout:
        self._key = ("update", update)
        try:
            return super().produce(update, timings, with_values)
        finally:
            self._key = None

    def _seed_key(self, batch: dict[str, Any]) -> tuple[Any, ...]:
        """What seeds the environments' randomness for ``batch``: the run's seed, the process and the
        update (in training), or the batch's prompt ids (evaluation, or a rollout outside train()), so
        evaluating the same prompts twice draws the same."""
        engine = self.engine
        key = self._key
        if key is None:
            ids = batch["input_ids"]
            digest = hashlib.sha256(ids.cpu().numpy().tobytes() + str(tuple(ids.shape)).encode()).hexdigest()
            key = ("batch", digest)
        return (engine.args.seed, engine.accelerator.process_index, *key)

    def sample(
        self,
        batch: dict[str, Any],
        copies: int = 1,
        with_logprobs: bool = False,
        timings: dict[str, float] | None = None,
    ) -> SampledResponses:
        """The episodes of ``copies`` completions per prompt of ``batch`` (see the module docstring)."""
        self._sample_key = self._seed_key(batch)
        #: The column the batch's prompts are in (``prompt`` or ``messages``; None for token ids).
        self._prompt_column = next((c for c in ("prompt", "messages") if c in batch), None)
        with seeded_random(*self._sample_key, "sample"):
            samples = super().sample(batch, copies, with_logprobs, timings)
        failures = [float(r in self.failed) for r in range(len(self.current))]
        samples.extra_metrics = {**(samples.extra_metrics or {}), RESET_FAILURES: failures}
        return samples

    def score(self, samples: SampledResponses, timings: dict[str, float] | None = None) -> Scores:
        """The multi-turn scoring with the rows' environments as the reward functions' ``environments``
        column (and the ``get_reward`` sources'); the rows whose reset failed get no reward (NaN)."""
        with_environments = dataclasses.replace(
            samples, columns={**samples.columns, "environments": self.current}
        )
        for source in self.engine.reward_sources.sources:
            if isinstance(source, EnvironmentReward):
                source.skip_rows = set(self.failed)  # a failed reset leaves no state to score
        with seeded_random(*self._sample_key, "score"):
            scores = super().score(with_environments, timings)
        if self.failed:
            rows = torch.tensor(sorted(self.failed), device=scores.total.device)
            scores.total = scores.total.clone()
            scores.total[rows] = float("nan")
        return scores

    # ---- episodes ----------------------------------------------------------------------------------

    def start_episodes(
        self, query: torch.Tensor, query_mask: torch.Tensor, prompts: list[Any], columns: dict[str, list[Any]]
    ) -> tuple[torch.Tensor, torch.Tensor, list[Episode]]:
        """Reset one environment per row (its row's columns as keywords) and start its episode from the
        prompt with what ``reset`` returned, rendered with that environment's tools."""
        rows = query.shape[0]
        names = self.environments.row_names(columns, rows)
        self.current = self.environments.assign(names)
        self.failed = set()
        rendered: dict[int, list[int]] = {}
        for r, (name, environment) in enumerate(zip(names, self.current, strict=True)):
            observation = self._reset(r, environment, prompts[r], columns)
            if r in self.failed:
                continue
            prompts[r] = observed_prompt(prompts[r], observation)
            if observation is not None or self.environments.multi:
                rendered[r] = self._render(prompts[r], self.environments.schemas[name], r)
        ids = [rendered[r] if r in rendered else query[r][query_mask[r]].tolist() for r in range(rows)]
        if rendered:
            query, query_mask = _left_padded(ids, self.engine.processing_class.pad_token_id, query)
        episodes = [
            Episode(prompt_ids=ids[r], toolbox=self.environments.toolbox(self.current[r]))
            for r in range(rows)
        ]
        return query, query_mask, episodes

    def _reset(self, row: int, environment: Any, prompt: Any, columns: Mapping[str, list[Any]]) -> Any:
        """``environment.reset(**row)``; a reset that raises marks the row failed (and returns None)."""
        kwargs = {name: values[row] for name, values in columns.items()}
        if self.environments.multi:
            kwargs.pop(ENVIRONMENT_COLUMN, None)
        kwargs = {self._prompt_column: prompt, **kwargs} if self._prompt_column else kwargs
        try:
            return environment.reset(**kwargs)
        except Exception as error:
            self.failed.add(row)
            if not self._warned:
                self._warned = True
                logger.warning(
                    "%s.reset() raised %s: %s. The episode runs without its environment and is left out of the "
                    "update (counted in %s); the run goes on.",
                    type(environment).__name__,
                    type(error).__name__,
                    error,
                    RESET_FAILURES,
                    exc_info=True,
                )
            return None

    def _render(self, prompt: Any, schemas: list[dict[str, Any]], row: int) -> list[int]:
        """The token ids of ``prompt`` as the dataset's prompts are made (chat template with these tools,
        ``max_prompt_length`` from the left)."""
        if self._prompt_column is None:
            raise ValueError(
                "reset() returned an observation (or environment_factory is a dict, whose rows are rendered with "
                "their environment's tools), but the dataset's prompts are token ids (an 'input_ids' column): "
                "give the prompts as text or chat messages in a 'prompt' column."
            )
        engine = self.engine
        tokenizer = engine.processing_class
        kwargs = {**(getattr(engine, "prompt_chat_template_kwargs", None) or {}), "tools": schemas or None}
        render = _PromptTokenizer(
            data_format="text" if isinstance(prompt, str) else "conversational",
            column="prompt",
            tokenizer=tokenizer,
            max_prompt_length=engine.args.max_prompt_length,
            vocab_size=None,
            bos_id=getattr(tokenizer, "bos_token_id", None),
            chat_template_kwargs=kwargs,
        )
        return render({"prompt": [prompt]}, [row])["input_ids"][0]

    def _tool_turns(self, episodes: list[Episode], active: list[int], iteration: int) -> list[int]:
        """The multi-turn tool turns, except for the episodes whose environment failed to reset: they end
        after their first turn."""
        return super()._tool_turns(episodes, [r for r in active if r not in self.failed], iteration)


def environment_setup(
    trainer: Any,
    environment_factory: Any,
    tools: Sequence[Callable[..., Any]] | None,
    args: Any,
    processing_class: Any,
    model: Any,
) -> tuple[EnvironmentSet, Toolbox, Any]:
    """Check ``environment_factory`` (one instance of each environment is made here) and the settings
    multi-turn rollouts need, before the models load; returns the environments, the union of their tools
    (what the dataset's prompts are first rendered with) and the policy's tokenizer."""
    check_multi_turn_support(args, "environment_factory= (multi-turn environment rollouts)")
    environments = EnvironmentSet(environment_factory, tools, timeout=args.tool_timeout)
    union = environments.union_toolbox()
    toolbox, processing_class = tool_setup(
        trainer, [union[n] for n in union.names], args, processing_class, model
    )
    return environments, toolbox if toolbox is not None else union, processing_class


def environment_reward_sources(environments: EnvironmentSet | None, on_error: str) -> list[EnvironmentReward]:
    """``get_reward`` of each environment class that has one, as reward sources (weight 1 each)."""
    if environments is None:
        return []
    return [EnvironmentReward(cls, on_error=on_error) for cls in environments.reward_classes]
