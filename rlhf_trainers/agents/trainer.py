"""What a trainer needs for multi-turn rollouts with tools: :class:`AgentRollouts`, mixed into
``PPOTrainer``, ``RLOOTrainer`` and ``GRPOTrainer`` before the engine (docs/agents.md).

The engine (:class:`~rlhf_trainers.onpolicy.trainer.OnPolicyTrainer`) calls two hooks: ``setup_tools``
before any model loads (checks ``tools=`` and the chat template, and sets the prompts' chat template
``tools=`` argument), and ``make_producer`` once its parts exist (the rollout producer of the run).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..onpolicy.producer import RolloutProducer
from .producer import MultiTurnProducer, tool_setup
from .tools import Toolbox


class AgentRollouts:
    """Gives an on-policy trainer TRL's ``tools=``: with tools, every rollout row is an episode of
    assistant turns and tool results (:class:`~rlhf_trainers.agents.producer.MultiTurnProducer`), at most
    ``args.max_tool_calling_iterations`` tool turns, each call limited to ``args.tool_timeout`` seconds."""

    #: The tools of the run; None without ``tools=``.
    toolbox: Toolbox | None = None

    def setup_tools(
        self, tools: Sequence[Callable[..., Any]] | None, args: Any, processing_class: Any, model: Any
    ) -> Any:
        """Check ``tools=`` (before the models load) and return the policy's tokenizer."""
        self.toolbox, processing_class = tool_setup(self, tools, args, processing_class, model)
        return processing_class

    def make_producer(self) -> RolloutProducer:
        """The multi-turn producer with tools; the engine's single-turn one without."""
        if self.toolbox is None:
            return super().make_producer()  # type: ignore[misc]
        return MultiTurnProducer(self, self.toolbox, self.args.max_tool_calling_iterations)  # type: ignore[attr-defined]
