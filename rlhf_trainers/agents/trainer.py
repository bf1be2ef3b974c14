"""What a trainer needs for multi-turn rollouts with tools and for a user's ``rollout_func``:
:class:`AgentRollouts`, mixed into ``PPOTrainer``, ``RLOOTrainer`` and ``GRPOTrainer`` before the engine
(docs/agents.md).

The engine (:class:`~rlhf_trainers.onpolicy.trainer.OnPolicyTrainer`) calls three hooks: ``setup_rollout_func``
and ``setup_tools`` before any model loads (check ``rollout_func=``, ``tools=`` and the chat template, and set
the prompts' chat template ``tools=`` argument), and ``make_producer`` once its parts exist (the rollout
producer of the run).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..onpolicy.producer import RolloutProducer
from .producer import MultiTurnProducer, tool_setup
from .tools import Toolbox
from .user_rollouts import RolloutFunc, UserRolloutProducer, check_rollout_func


class AgentRollouts:
    """Gives an on-policy trainer TRL's ``tools=`` and ``rollout_func=``: with tools, every rollout row is
    an episode of assistant turns and tool results (:class:`~rlhf_trainers.agents.producer.MultiTurnProducer`),
    at most ``args.max_tool_calling_iterations`` tool turns, each call limited to ``args.tool_timeout``
    seconds; with a ``rollout_func``, the function makes the completions
    (:class:`~rlhf_trainers.agents.user_rollouts.UserRolloutProducer`)."""

    #: The tools of the run; None without ``tools=``.
    toolbox: Toolbox | None = None
    #: The user's generation function; None without ``rollout_func=``.
    rollout_func: RolloutFunc | None = None

    def setup_rollout_func(self, rollout_func: RolloutFunc | None, tools: Any, args: Any) -> None:
        """Check ``rollout_func=`` (before the models load): callable, and not with ``tools=``."""
        self.rollout_func = check_rollout_func(rollout_func, tools, args)

    def setup_tools(
        self, tools: Sequence[Callable[..., Any]] | None, args: Any, processing_class: Any, model: Any
    ) -> Any:
        """Check ``tools=`` (before the models load) and return the policy's tokenizer."""
        self.toolbox, processing_class = tool_setup(self, tools, args, processing_class, model)
        return processing_class

    def make_producer(self) -> RolloutProducer:
        """The user's ``rollout_func``'s producer; the multi-turn producer with tools; the engine's
        single-turn one otherwise."""
        if self.rollout_func is not None:
            return UserRolloutProducer(self, self.rollout_func)
        if self.toolbox is None:
            return super().make_producer()  # type: ignore[misc]
        return MultiTurnProducer(self, self.toolbox, self.args.max_tool_calling_iterations)  # type: ignore[attr-defined]
