"""Every problem of a config, reported at once.

The configs' ``__post_init__`` checks add what they find to a :class:`ConfigProblems` instead of
raising at the first one, and raise one :class:`ConfigError` (a ``ValueError``) listing them all at the
end, so that fixing one value does not merely reveal the next. The checks of the optimizer settings
that every config inherits from ``TrainingArguments`` (:func:`check_optimizer_fields`) live here too:
``torch.optim`` would otherwise refuse a negative learning rate only once the model has loaded.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any


class ConfigError(ValueError):
    """A config's problems, each one line in :attr:`problems`; the message lists them all (or is the
    one problem's message when there is only one)."""

    def __init__(self, config_name: str, problems: Sequence[str]) -> None:
        self.config_name = config_name
        self.problems = list(problems)
        if len(self.problems) == 1:
            text = self.problems[0]
        else:
            listed = "\n".join(f"  - {problem}" for problem in self.problems)
            text = f"{config_name} has {len(self.problems)} problems:\n{listed}"
        super().__init__(text)


class ConfigProblems:
    """Collects the problems a config's checks find; :meth:`raise_if_any` raises them together.

    Args:
        config: the config being checked (its class names the error).
    """

    def __init__(self, config: Any) -> None:
        self.config_name = type(config).__name__
        self.problems: list[str] = []

    def __bool__(self) -> bool:
        return bool(self.problems)

    def add(self, message: str) -> None:
        """Record one problem (a message saying what was given, what is expected and how to fix it)."""
        if message not in self.problems:
            self.problems.append(message)

    def mentions(self, field_name: str) -> bool:
        """Whether a problem recorded so far is about `field_name` (starts with ``field_name=``)."""
        return any(problem.startswith(f"{field_name}=") for problem in self.problems)

    @contextlib.contextmanager
    def collect(self, reword: Callable[[ValueError], ValueError] | None = None) -> Iterator[None]:
        """Record the ``ValueError`` raised inside (each problem of a :class:`ConfigError`) instead of
        letting it propagate; `reword` may rewrite each first (e.g. to name a field by its alias)."""
        try:
            yield
        except ConfigError as error:
            for problem in error.problems:
                self.add(str(reword(ValueError(problem))) if reword else problem)
        except ValueError as error:
            self.add(str(reword(error)) if reword else str(error))

    def raise_if_any(self) -> None:
        """Raise a :class:`ConfigError` listing every problem recorded, if there is any."""
        if self.problems:
            raise ConfigError(self.config_name, self.problems)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_optimizer_fields(config: Any, problems: ConfigProblems) -> None:
    """The optimizer settings of ``TrainingArguments``: the values ``torch.optim`` (and the trainers'
    schedules) accept, checked when the config is built rather than once the model has loaded
    (``warmup_steps`` is checked by ``TrainingArguments`` itself)."""
    lr = config.learning_rate
    if not (_is_number(lr) and lr >= 0):
        problems.add(
            f"learning_rate={lr!r}: expected a finite number >= 0 (e.g. 1e-6 for a policy, 1e-5 for a reward model)."
        )
    if not (_is_number(config.weight_decay) and config.weight_decay >= 0):
        problems.add(f"weight_decay={config.weight_decay!r}: expected a finite number >= 0 (0.0: none).")
    for name in ("adam_beta1", "adam_beta2"):
        value = getattr(config, name)
        if not (_is_number(value) and 0 <= value < 1):
            problems.add(f"{name}={value!r}: expected a number in [0, 1) (defaults 0.9 and 0.999).")
    if not (_is_number(config.adam_epsilon) and config.adam_epsilon >= 0):
        problems.add(f"adam_epsilon={config.adam_epsilon!r}: expected a small finite number >= 0, e.g. 1e-8.")
    norm = config.max_grad_norm
    if norm is not None and not (_is_number(norm) and norm >= 0):
        problems.add(f"max_grad_norm={norm!r}: expected a finite number >= 0 (0 or None: no clipping).")
    epochs = config.num_train_epochs
    if not (_is_number(epochs) and epochs > 0) and config.max_steps <= 0:
        problems.add(f"num_train_epochs={epochs!r}: expected a number > 0 (or set max_steps).")
    for name in ("gradient_accumulation_steps", "per_device_train_batch_size", "per_device_eval_batch_size"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.add(f"{name}={value!r}: expected an integer >= 1.")


def parse_json_field(name: str, text: str) -> Any:
    """A dict field given as JSON text (the command line's form), or a ValueError naming the field."""
    import json

    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{name}={text!r}: not valid JSON ({error.msg} at character {error.pos}); write it as an object, "
            'e.g. \'{"dtype": "bfloat16"}\'.'
        ) from error
