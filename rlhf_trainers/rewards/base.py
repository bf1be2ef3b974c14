"""The reward-source protocol: what every reward source takes (:class:`RewardBatch`) and returns (one float
per completion, NaN for "no reward")."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from ..data.common import Prompt, is_message_list

__all__ = ["Prompt", "RewardBatch", "RewardLog", "RewardSource", "is_reward_source"]


class RewardLog:
    """What reward functions logged while a batch was scored: scalar metrics (``log_metric``) and columns
    of the completions table (``log_extra``), TRL's two logging hooks.

    A reward function receives :meth:`log_metric` and :meth:`log_extra` as its ``log_metric`` and
    ``log_extra`` keyword arguments. The on-policy trainers log each metric's mean over all processes
    beside their own metrics of the update (``evaluate()``: with the ``eval_`` prefix), and keep the
    columns with the rollout (``Rollout.reward_columns``) for the completions table.

    Attributes:
        metrics: every value logged per metric name, in the order logged.
        columns: every value logged per column name, in the order logged (a function logs one value per
            completion of the batch; two calls for the same column are concatenated).
    """

    def __init__(self) -> None:
        self.metrics: dict[str, list[float]] = {}
        self.columns: dict[str, list[Any]] = {}

    def log_metric(self, name: str, value: float) -> None:
        """Add ``value`` to the metric ``name`` (the logged number is the mean of the values given).

        Raises:
            TypeError: ``name`` is not a non-empty string, or ``value`` is not a real number.
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"log_metric(name, value): name must be a non-empty string, got {name!r}.")
        try:
            if isinstance(value, (str, bytes)):
                raise TypeError
            number = float(value)
        except (TypeError, ValueError, RuntimeError) as err:  # RuntimeError: a tensor of several values
            raise TypeError(
                f"log_metric({name!r}, value): value must be one real number, got {type(value).__name__}: "
                f"{value!r}."
            ) from err
        self.metrics.setdefault(name, []).append(number)

    def log_extra(self, column: str, values: Sequence[Any]) -> None:
        """Add ``values`` (one per completion of the batch, in its order) to the column ``column`` of the
        completions table.

        Raises:
            TypeError: ``column`` is not a non-empty string, or ``values`` is a string or not a sequence.
        """
        if not isinstance(column, str) or not column:
            raise TypeError(f"log_extra(column, values): column must be a non-empty string, got {column!r}.")
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
            raise TypeError(
                f"log_extra({column!r}, values): values must be a list with one value per completion, got "
                f"{type(values).__name__}: {values!r}."
            )
        self.columns.setdefault(column, []).extend(list(values))

    def update(self, other: RewardLog) -> None:
        """Append everything ``other`` logged to this log."""
        for name, values in other.metrics.items():
            self.metrics.setdefault(name, []).extend(values)
        for name, values in other.columns.items():
            self.columns.setdefault(name, []).extend(values)

    def __bool__(self) -> bool:
        return bool(self.metrics or self.columns)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(metrics={sorted(self.metrics)}, columns={sorted(self.columns)})"


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
    #: Response tokens of each completion (up to and including its stop token), B ints. None: not known
    #: (:meth:`completion_id_lists` then strips the trailing ``pad_token_id`` of each row).
    completion_lengths: Sequence[int] | None = None
    #: The trainer's ``transformers.TrainerState`` (``global_step``, ``max_steps``, ...), for rewards that
    #: change over training; None outside a trainer.
    trainer_state: Any = None
    #: Where the reward functions' ``log_metric`` and ``log_extra`` calls go (one log per batch).
    log: RewardLog = field(default_factory=RewardLog)
    #: For a multi-turn rollout with conversational prompts, each completion as its messages (the
    #: assistant turns with their tool calls, and the tool results), what reward functions receive as
    #: ``completions`` (TRL's convention for tool runs); None: one assistant message of the decoded text.
    conversations: Sequence[list[dict[str, Any]]] | None = None

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def is_conversational(self) -> bool:
        """Whether the prompts are chat messages (the first prompt a list of ``{"role", "content"}``
        dicts), TRL's test of a conversational batch."""
        return len(self.prompts) > 0 and is_message_list(self.prompts[0])

    def function_completions(self) -> list[Any]:
        """The completions as reward functions receive them, in TRL's convention: for conversational
        prompts each completion as a one-message list ``[{"role": "assistant", "content": text}]`` (a
        multi-turn rollout's: its :attr:`conversations`),
        otherwise the decoded strings."""
        if self.is_conversational:
            if self.conversations is not None:
                return [list(messages) for messages in self.conversations]
            return [[{"role": "assistant", "content": text}] for text in self.completions]
        return list(self.completions)

    @property
    def has_completion_ids(self) -> bool:
        """Whether the batch carries the completions' token ids (:attr:`completion_ids`)."""
        return self.query_response_ids is not None and self.prompt_width is not None

    def completion_id_lists(self) -> list[list[int]]:
        """Each completion's token ids without padding, as lists of ints (TRL's ``completion_ids``): the
        first ``completion_lengths[i]`` response ids of row i (the stop token included); without
        ``completion_lengths``, the response ids up to the last id that is not ``pad_token_id`` (a stop
        token equal to the pad token is then dropped as well).

        Raises:
            ValueError: when the batch has no ids or no ``prompt_width``.
        """
        ids = self.completion_ids.cpu()
        if self.completion_lengths is not None:
            lengths = [int(n) for n in self.completion_lengths]
        elif self.pad_token_id is None:
            lengths = [ids.shape[1]] * ids.shape[0]
        else:
            real = (ids != self.pad_token_id).long()
            positions = torch.arange(1, ids.shape[1] + 1)
            lengths = (real * positions).amax(dim=1).tolist() if ids.shape[1] else [0] * ids.shape[0]
        return [row[:n].tolist() for row, n in zip(ids, lengths, strict=True)]

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
    names unique with ``_2``, ``_3``, ... suffixes) and a ``score`` method. Optional members are used
    when present: ``check(batch)``, called on every source before any source scores (to refuse a
    batch early, e.g. a missing dataset column); ``last_errors``, the number of rows of the last
    ``score`` call that could not be scored because the source failed (summed into
    ``rollout/reward_func_errors``; the source's NaN rows of that call then leave the update, whatever the
    other sources gave); and ``is_async`` (True) with a coroutine method ``ascore(batch)``, which
    :class:`~rlhf_trainers.rewards.RewardSources` awaits, concurrently with the other asynchronous
    sources, instead of calling ``score``. A source is given to the trainers in ``reward_funcs``, next to
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
