"""What a trainer needs for multi-turn rollouts with tools and for a user's ``rollout_func``:
:class:`AgentRollouts`, mixed into ``PPOTrainer``, ``RLOOTrainer`` and ``GRPOTrainer`` before the engine
(docs/agents.md).

The engine (:class:`~rlhf_trainers.onpolicy.trainer.OnPolicyTrainer`) calls the hooks of
:class:`~rlhf_trainers.onpolicy.producer.ProducerHooks`: before any model loads ``default_train_dataset``
(environments that own their data), ``setup_rollouts`` (checks ``tools=``, ``environment_factory=``,
``rollout_func=`` and the chat template, and sets the prompts' chat template ``tools=`` argument) and
``extra_reward_sources`` (the environments' ``get_reward``); ``make_producer`` once its parts exist (the
rollout producer of the run).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..onpolicy.producer import RolloutProducer
from .environment_producer import EnvironmentProducer, environment_reward_sources, environment_setup
from .environments import ENVIRONMENT_COLUMN, EnvironmentSet
from .producer import MultiTurnProducer, tool_setup
from .tools import Toolbox
from .user_rollouts import RolloutFunc, UserRolloutProducer, check_rollout_func


class AgentRollouts:
    """Gives an on-policy trainer TRL's ``tools=``, ``environment_factory=`` and ``rollout_func=``: with
    tools or environments, every rollout row is an episode of assistant turns and tool results
    (:class:`~rlhf_trainers.agents.producer.MultiTurnProducer`; with environments
    :class:`~rlhf_trainers.agents.environment_producer.EnvironmentProducer`, one environment per episode),
    at most ``args.max_tool_calling_iterations`` tool turns, each call limited to ``args.tool_timeout``
    seconds; with a ``rollout_func``, the function makes the completions
    (:class:`~rlhf_trainers.agents.user_rollouts.UserRolloutProducer`)."""

    #: The tools of the run (with environments: the union of theirs); None without tools.
    toolbox: Toolbox | None = None
    #: The environments of the run; None without ``environment_factory=``.
    environments: EnvironmentSet | None = None
    #: The user's generation function; None without ``rollout_func=``.
    rollout_func: RolloutFunc | None = None

    def setup_rollouts(
        self,
        args: Any,
        model: Any,
        processing_class: Any,
        *,
        tools: Sequence[Callable[..., Any]] | None = None,
        environment_factory: Any = None,
        rollout_func: RolloutFunc | None = None,
    ) -> Any:
        """Check ``rollout_func=``, ``tools=`` and ``environment_factory=`` (before the models load) and
        return the policy's tokenizer."""
        self.rollout_func = check_rollout_func(rollout_func, tools, args, environment_factory)
        if environment_factory is None:
            self.toolbox, processing_class = tool_setup(self, tools, args, processing_class, model)
            return processing_class
        self.environments, self.toolbox, processing_class = environment_setup(
            self, environment_factory, tools, args, processing_class, model
        )
        return processing_class

    def default_train_dataset(self, train_dataset: Any, args: Any, environment_factory: Any) -> Any:
        """TRL's environment-owned data: without a ``train_dataset``, a single ``environment_factory``
        whose ``reset()`` returns each episode's prompt trains on placeholder rows of one empty user
        message (as many as one update's completions), for ``max_steps`` updates."""
        if train_dataset is not None or environment_factory is None:
            return train_dataset
        if isinstance(environment_factory, Mapping):
            raise ValueError(
                "A dict environment_factory (several environments) needs a train_dataset with an 'environment' "
                "column to pick each row's environment; pass one, or a single factory."
            )
        if args.max_steps is None or args.max_steps <= 0:
            raise ValueError(
                "Without a train_dataset (the environment owns the data: its reset() returns each prompt), "
                f"max_steps sets the length of the run; got max_steps={args.max_steps}. Set max_steps=<updates>."
            )
        import datasets

        rows = max(1, args.local_batch_size * args.world_size)
        return datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]] * rows})

    def extra_reward_sources(self, args: Any) -> list[Any]:
        """The environments' ``get_reward`` as reward sources (weight 1 each, after ``reward_funcs``)."""
        return environment_reward_sources(self.environments, args.reward_func_errors)

    def make_producer(self) -> RolloutProducer:
        """The user's ``rollout_func``'s producer; the environment producer with ``environment_factory``;
        the multi-turn producer with tools; the engine's single-turn one otherwise."""
        if self.rollout_func is not None:
            return UserRolloutProducer(self, self.rollout_func)
        if self.environments is not None:
            self._check_environment_columns()
            return EnvironmentProducer(self, self.environments, self.args.max_tool_calling_iterations)  # type: ignore[attr-defined]
        if self.toolbox is None:
            return super().make_producer()  # type: ignore[misc]
        return MultiTurnProducer(self, self.toolbox, self.args.max_tool_calling_iterations)  # type: ignore[attr-defined]

    def _check_environment_columns(self) -> None:
        """With a dict of factories, every row of the datasets must name one of them (at construction)."""
        environments = self.environments
        if environments is None or not environments.multi:
            return
        for dataset in (self.train_dataset, self.eval_dataset):  # type: ignore[attr-defined]
            if dataset is None or not hasattr(dataset, "column_names"):
                continue
            if ENVIRONMENT_COLUMN not in dataset.column_names:
                raise ValueError(environments.missing_column_message(dataset.column_names))
            environments.row_names({ENVIRONMENT_COLUMN: dataset[ENVIRONMENT_COLUMN]}, len(dataset))
