"""Environments: TRL 1.16's ``environment_factory`` (docs/agents.md, "Environments").

An *environment* is an object made by a factory (a zero-argument callable, usually the class itself)
with a ``reset(**row)`` method, public methods that are the policy's tools, and optionally a
``get_reward()`` that scores the episode it just ran from its own state. :class:`EnvironmentSet` holds
the factories of a run (one, or several by name: a dataset column ``environment`` picks each row's),
checks them at construction by making one instance of each, keeps a pool of instances that episodes
reuse (reset between episodes, as TRL does: an expensive ``__init__`` is paid once per concurrent
episode, not per step), and gives each instance its own :class:`~rlhf_trainers.agents.Toolbox` of the
standalone tools and its bound methods. :class:`EnvironmentReward` is ``get_reward`` as a reward source
(weight 1, named after the environment's class). :func:`seeded_random` makes what environments draw
from Python's ``random`` (and NumPy's global generator) a function of the run's seed and the update, so a
resumed run continues exactly.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import math
import random
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..rewards.functions import is_async_reward_func
from .tools import Toolbox, environment_tools

__all__ = [
    "ENVIRONMENT_COLUMN",
    "EnvironmentReward",
    "EnvironmentSet",
    "observed_prompt",
    "seeded_random",
]

#: The dataset column that names each row's environment when ``environment_factory`` is a dict (TRL's).
ENVIRONMENT_COLUMN = "environment"

EnvironmentFactory = Callable[[], Any]


def _factory_label(name: str | None) -> str:
    return "environment_factory" if name is None else f"environment_factory[{name!r}]"


class EnvironmentSet:
    """The environments of a run: their factories, a pool of instances, and each instance's tools.

    Args:
        environment_factory: a zero-argument callable returning a new environment (e.g. the class), or a
            dict of them by name (each row's ``environment`` column picks one, and only that
            environment's tools are offered in its prompt).
        tools: standalone tools offered next to every environment's methods (TRL's ``tools=``).
        timeout: seconds one tool call may take (``tool_timeout``); None: no limit.

    Raises:
        ValueError: a factory that is not callable, an empty dict or a name that is not a string, a
            factory that raises or returns something without a ``reset`` method, a ``get_reward`` that is
            not a method, and tools that cannot be described (named, as :class:`Toolbox` names them).
    """

    def __init__(
        self,
        environment_factory: EnvironmentFactory | Mapping[str, EnvironmentFactory],
        tools: Sequence[Callable[..., Any]] | None = None,
        timeout: float | None = None,
    ) -> None:
        self.multi = isinstance(environment_factory, Mapping)
        self.factories: dict[str | None, EnvironmentFactory] = _checked_factories(environment_factory)
        self.standalone = list(tools or [])
        self.timeout = timeout
        self.pools: dict[str | None, list[Any]] = {name: [] for name in self.factories}
        self._toolboxes: dict[int, Toolbox] = {}
        #: Per environment name: the schemas its rows' prompts are rendered with (standalone tools first).
        self.schemas: dict[str | None, list[dict[str, Any]]] = {}
        #: The classes whose instances score their episodes (``get_reward``), each once, in factory order.
        self.reward_classes: list[type] = []
        for name in self.factories:
            probe = self.create(name)
            self.pools[name].append(probe)
            self.schemas[name] = self.toolbox(probe).schemas
            if _has_get_reward(probe) and type(probe) not in self.reward_classes:
                self.reward_classes.append(type(probe))

    @property
    def names(self) -> list[str | None]:
        """The environments' names (``[None]`` for a single factory)."""
        return list(self.factories)

    def create(self, name: str | None) -> Any:
        """A new instance of environment ``name``, checked (it has a ``reset`` method), with its toolbox."""
        label = _factory_label(name)
        try:
            environment = self.factories[name]()
        except Exception as error:
            raise ValueError(
                f"{label}() raised {type(error).__name__}: {error}. The factory is called with no arguments to "
                "make each environment (pass the class itself, or a function or functools.partial that builds "
                "one)."
            ) from error
        if not callable(getattr(environment, "reset", None)):
            raise ValueError(
                f"{label}() returned {type(environment).__name__} ({environment!r:.80}), which has no reset() "
                "method. An environment is an object with a reset(**row) method (called when an episode starts; "
                "it returns None or a string appended to the prompt's last message) and public methods, which "
                "are the policy's tools; get_reward() is optional. Pass a factory that returns one, e.g. the "
                "environment class itself."
            )
        reward = getattr(type(environment), "get_reward", None)
        if reward is not None and not inspect.isfunction(reward):
            raise ValueError(
                f"{label}() returned a {type(environment).__name__} whose get_reward is not a method "
                f"({reward!r}); get_reward(self) -> float scores the episode from the environment's state."
            )
        try:
            methods = environment_tools(environment)
            self._toolboxes[id(environment)] = Toolbox([*self.standalone, *methods], timeout=self.timeout)
        except ValueError as error:
            raise ValueError(
                f"The tools of {label}'s {type(environment).__name__} (its public methods, with the standalone "
                f"tools) cannot be offered: {error}"
            ) from error
        return environment

    def toolbox(self, environment: Any) -> Toolbox:
        """The tools of ``environment``: the standalone tools and its public methods, bound to it."""
        return self._toolboxes[id(environment)]

    def union_toolbox(self) -> Toolbox:
        """Every tool of the run, one per name (the first environment's where names repeat): what the
        dataset's prompts are first rendered with (their lengths checked against the model)."""
        seen: dict[str, Callable[..., Any]] = {}
        for name in self.factories:
            box = self.toolbox(self.pools[name][0])
            for tool in box.names:
                seen.setdefault(tool, box[tool])
        return Toolbox(list(seen.values()), timeout=self.timeout)

    def row_names(self, columns: Mapping[str, Sequence[Any]], rows: int) -> list[str | None]:
        """Each row's environment name: its ``environment`` column with several factories, None else."""
        if not self.multi:
            return [None] * rows
        if ENVIRONMENT_COLUMN not in columns:
            raise ValueError(self.missing_column_message(sorted(columns)))
        names = list(columns[ENVIRONMENT_COLUMN])
        unknown = sorted({str(n) for n in names if n not in self.factories})
        if unknown:
            raise ValueError(self.unknown_names_message(unknown))
        return names

    def missing_column_message(self, columns: Sequence[str]) -> str:
        return (
            f"environment_factory is a dict of {len(self.factories)} environments ({self.names}), so each row "
            f"must name its environment in a column {ENVIRONMENT_COLUMN!r}; the dataset's columns are "
            f"{list(columns)}. Add that column, or pass a single factory."
        )

    def unknown_names_message(self, unknown: Sequence[str]) -> str:
        return (
            f"rows name the environment(s) {list(unknown)} in column {ENVIRONMENT_COLUMN!r}, which are not keys "
            f"of environment_factory; expected one of {self.names}."
        )

    def assign(self, names: Sequence[str | None]) -> list[Any]:
        """One instance per row, from each environment's pool (grown when a batch needs more instances of
        an environment than were made so far). Making instances leaves Python's random state as it was."""
        taken: dict[str | None, int] = {}
        out = []
        for name in names:
            index = taken.get(name, 0)
            pool = self.pools[name]
            if index == len(pool):
                with preserved_random():
                    pool.append(self.create(name))
            taken[name] = index + 1
            out.append(pool[index])
        return out


def _checked_factories(factory: Any) -> dict[str | None, EnvironmentFactory]:
    if isinstance(factory, Mapping):
        if not factory:
            raise ValueError(
                "environment_factory is an empty dict; give {name: factory} with at least one environment, or "
                "a single factory."
            )
        bad_names = [name for name in factory if not isinstance(name, str)]
        if bad_names:
            raise ValueError(
                f"environment_factory's keys must be the environment names (strings) that the dataset's "
                f"{ENVIRONMENT_COLUMN!r} column uses; got {bad_names!r}."
            )
        factories: dict[str | None, EnvironmentFactory] = dict(factory)
    else:
        factories = {None: factory}
    for name, value in factories.items():
        if not callable(value):
            raise ValueError(
                f"{_factory_label(name)} must be a callable that returns a new environment (e.g. the "
                f"environment class itself), got {type(value).__name__}: {value!r:.80}. Pass the class, not an "
                "instance."
            )
    return factories


def _has_get_reward(environment: Any) -> bool:
    return inspect.isfunction(getattr(type(environment), "get_reward", None))


class EnvironmentReward:
    """``get_reward()`` of the environments of one class as a reward source (TRL's: weight 1, named after
    the class): each row whose environment is exactly that class is scored by calling its ``get_reward``
    once the episode is over; other rows get NaN (no reward from this source). The environments of a batch
    arrive in its ``environments`` column (one per row), which the environment producer adds.

    Args:
        environment_class: the class whose instances are scored.
        on_error: ``"raise"``: a ``get_reward`` that raises stops the run (with the row and class named);
            ``"skip"``: the row is unscored (NaN) and counted in ``last_errors``.
    """

    def __init__(self, environment_class: type, on_error: str = "raise") -> None:
        self.environment_class = environment_class
        self.name = environment_class.__name__
        self.on_error = on_error
        self.is_async = is_async_reward_func(environment_class.get_reward)
        self.last_errors = 0
        #: Rows of the next batch not to score (their environment's reset raised); the producer sets it.
        self.skip_rows: set[int] = set()

    def _environments(self, batch: Any) -> list[Any]:
        environments = batch.columns.get("environments")
        if environments is None:
            raise ValueError(
                f"reward source {self.name!r} scores environments, but the batch has no 'environments' column "
                "(it is only used by a trainer built with environment_factory=)."
            )
        return list(environments)

    def _failed(self, row: int, error: BaseException) -> float:
        if self.on_error != "skip":
            raise RuntimeError(
                f"{self.name}.get_reward() raised {type(error).__name__} for row {row}: {error}"
            ) from error
        self.last_errors += 1
        return math.nan

    @staticmethod
    def _value(value: Any) -> float:
        return math.nan if value is None else float(value)

    def score(self, batch: Any) -> torch.Tensor:
        """The rewards of ``batch``: float32 (B,), NaN where the row's environment is another class."""
        self.last_errors = 0
        out = []
        for row, environment in enumerate(self._environments(batch)):
            if type(environment) is not self.environment_class or row in self.skip_rows:
                out.append(math.nan)
                continue
            try:
                out.append(self._value(environment.get_reward()))
            except Exception as error:
                out.append(self._failed(row, error))
        return torch.tensor(out, dtype=torch.float32)

    async def ascore(self, batch: Any) -> torch.Tensor:
        """:meth:`score` for an ``async def get_reward``, awaited row by row."""
        self.last_errors = 0
        out = []
        for row, environment in enumerate(self._environments(batch)):
            if type(environment) is not self.environment_class or row in self.skip_rows:
                out.append(math.nan)
                continue
            try:
                out.append(self._value(await environment.get_reward()))
            except Exception as error:
                out.append(self._failed(row, error))
        return torch.tensor(out, dtype=torch.float32)


def observed_prompt(prompt: Any, observation: Any) -> Any:
    """``prompt`` with what ``reset()`` returned appended, as TRL does: to the content of the last message
    of a conversation (a string to a string; text and content-block lists are joined as blocks), or to
    the end of a text prompt. ``observation`` None leaves the prompt as it is. The prompt is not changed
    in place."""
    if observation is None:
        return prompt
    if isinstance(prompt, str):
        if not isinstance(observation, str):
            raise ValueError(
                f"reset() returned {type(observation).__name__} for a text prompt; return None or a string."
            )
        return prompt + observation
    if not isinstance(observation, (str, list)):
        raise ValueError(
            f"reset() must return None, a string or a list of content blocks, got {type(observation).__name__}: "
            f"{observation!r:.80}."
        )
    last = prompt[-1]
    content = last.get("content")
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return [
        *prompt[:-1],
        {**last, "content": (content or ("" if isinstance(observation, str) else [])) + observation},
    ]


def _numpy_random() -> Any:
    numpy = sys.modules.get("numpy")
    return getattr(numpy, "random", None) if numpy is not None else None


@contextlib.contextmanager
def preserved_random() -> Iterator[None]:
    """Python's ``random`` (and NumPy's global generator) in the same state after the block as before."""
    state = random.getstate()
    np_random = _numpy_random()
    np_state = np_random.get_state() if np_random is not None else None
    try:
        yield
    finally:
        random.setstate(state)
        if np_random is not None:
            np_random.set_state(np_state)


@contextlib.contextmanager
def seeded_random(*key: Any) -> Iterator[None]:
    """Seed Python's ``random`` (and NumPy's global generator, if NumPy is loaded) from ``key`` for the
    block, and give them back their state after it: what environments draw in the block depends on
    ``key`` only (the run's seed and the update), so a resumed run draws the same."""
    digest = hashlib.sha256(repr(key).encode()).digest()
    seed = int.from_bytes(digest[:8], "little")
    with preserved_random():
        random.seed(seed)
        np_random = _numpy_random()
        if np_random is not None:
            np_random.seed(seed % 2**32)
        yield
