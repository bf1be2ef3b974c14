"""The reward-source protocol: what every reward source takes (:class:`RewardBatch`) and returns (one float
per completion, NaN for "no reward")."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from ..data.common import Prompt

__all__ = ["Prompt", "RewardBatch", "RewardSource", "is_reward_source"]


@dataclass(frozen=True)
class RewardBatch:
    """B completions of a rollout batch, in every form a reward source may want to read them.

    The on-policy trainers build one per rollout batch and give the same object to every source, which
    must not modify it (the sequences and tensors are shared).
    """

    #: The B prompts as in the dataset (strings or lists of ``{"role", "content"}``).
    prompts: Sequence[Prompt]
    #: The B decoded completions (special tokens skipped).
    completions: Sequence[str]
    #: (B, T) the left-padded prompt ids followed by the response ids, the response right-padded after it
    #: stops; both paddings use ``pad_token_id`` (the policy tokenizer's). None where no ids exist.
    query_response_ids: torch.Tensor | None = None
    #: The id that pads ``query_response_ids``.
    pad_token_id: int | None = None
    #: Columns of ``query_response_ids`` that belong to the (left-padded) prompts; the rest is the
    #: response. None: not known (:attr:`completion_ids` is then unavailable).
    prompt_width: int | None = None
    #: The other dataset columns of these rows, each a sequence of length B.
    columns: Mapping[str, Sequence[Any]] = field(default_factory=dict)
    #: Replaces the trainer's reward model's ``__call__`` (e.g. a DeepSpeed engine); sources without that
    #: model ignore it.
    reward_model_forward: Callable[..., Any] | None = None

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def completion_ids(self) -> torch.Tensor:
        """(B, R) the response ids, right-padded with ``pad_token_id`` after each response stops.

        Raises:
            ValueError: when the batch has no ids or no ``prompt_width``.
        """
        if self.query_response_ids is None or self.prompt_width is None:
            raise ValueError(
                "this reward batch carries no completion ids (query_response_ids and prompt_width are needed)."
            )
        return self.query_response_ids[:, self.prompt_width :]


@runtime_checkable
class RewardSource(Protocol):
    """Anything that scores a batch of completions: a reward model, a Python reward function, an RLVR
    grader, or a class of your own.

    A source needs two things: a ``name`` (its metric is ``objective/scores/<name>``; the trainers make
    names unique with ``_2``, ``_3``, ... suffixes) and a ``score`` method. Two optional members are
    used when present: ``check(batch)``, called on every source before any source scores (to refuse a
    batch early, e.g. a missing dataset column), and ``last_errors``, the number of rows of the last
    ``score`` call that could not be scored because the source failed (summed into
    ``rollout/reward_func_errors``). A source is given to the trainers in ``reward_funcs``, next to
    plain functions, and weighted by ``reward_weights`` like them.

    Example::

        class LengthPenalty:
            name = "length_penalty"

            def score(self, batch: RewardBatch) -> torch.Tensor:
                return -torch.tensor([len(c) for c in batch.completions], dtype=torch.float32) / 100
    """

    #: The source's name in metrics and in ``reward_weights``' order.
    name: str

    def score(self, batch: RewardBatch) -> torch.Tensor:
        """One reward per completion of ``batch``.

        Returns:
            a float32 (B,) CPU tensor, NaN where the source gives no reward for a row (that row then
            takes no part in the update unless the caller decides otherwise).
        """
        ...


def is_reward_source(value: Any) -> bool:
    """Whether ``value`` implements :class:`RewardSource` (a ``name`` string and a callable ``score``)."""
    return isinstance(getattr(value, "name", None), str) and callable(getattr(value, "score", None))
