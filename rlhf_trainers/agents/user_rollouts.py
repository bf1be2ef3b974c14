"""TRL's ``rollout_func``: completions made by a function the user gives (docs/agents.md, "rollout_func").

``GRPOTrainer(..., rollout_func=f)`` (and ``RLOOTrainer``, ``PPOTrainer``) hands generation to ``f``. As in
TRL 1.16, ``f(prompts, trainer)`` receives this process's prompts of the batch as the dataset holds them
(text, or chat messages: no chat template applied), each repeated ``num_generations`` times in a row,
and returns a dict with one entry per prompt it was given in each of:

- ``prompt_ids``: the prompt's token ids, as the completion was generated from them;
- ``completion_ids``: the completion's token ids (at most ``max_completion_length``);
- ``logprobs``: the log-probability of each completion token under the generator, or None;
- optionally ``env_mask``: per completion token, 1 where the policy wrote it and 0 where something else
  inserted it (an environment's reply): 0 tokens stay in the sequence but carry no loss;
- any other key: forwarded to the reward functions as a keyword argument (a list: one value per
  prompt; anything else: the same value for every completion).

:class:`UserRolloutProducer` is the engine's rollout producer for such a run: it calls the function,
checks what it returned (:func:`read_rollout`), and builds the rollout from it; scoring, the forward
passes and the update are the single-turn producer's.
"""

from __future__ import annotations

import copy
import numbers
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..models import context_length, embedding_rows
from ..onpolicy.producer import SingleTurnProducer
from ..onpolicy.rollout import ForwardPasses, Rollout, SampledResponses, Scores
from ..rewards.functions import REWARD_FUNC_ARGS
from .producer import _left_padded, turn_end_ids

#: ``rollout_func(prompts, trainer) -> dict``: TRL 1.16's ``RolloutFunc``.
RolloutFunc = Callable[[list[Any], Any], Mapping[str, Any]]

#: The keys every ``rollout_func`` result must have (TRL's).
REQUIRED_KEYS = ("prompt_ids", "completion_ids", "logprobs")

#: The optional key that marks the policy's completion tokens (TRL's ``env_mask``); not forwarded.
MASK_KEY = "env_mask"


def check_rollout_func(
    rollout_func: Any, tools: Any, args: Any, environment_factory: Any = None
) -> RolloutFunc | None:
    """Check a trainer's ``rollout_func=`` before anything loads; returns it (None without one).

    Raises:
        TypeError: it is not callable.
        ValueError: it comes with ``tools=``, ``environment_factory=`` or a setting that only the builtin sampler's responses have
            (``dynamic_sampling``, ``truncate_after``).
    """
    if rollout_func is None:
        return None
    if not callable(rollout_func):
        raise TypeError(
            f"rollout_func must be a function rollout_func(prompts, trainer) -> dict, got "
            f"{type(rollout_func).__name__}."
        )
    unsupported = {
        "tools=": bool(tools),
        "environment_factory=": environment_factory is not None,
        "dynamic_sampling=True": args.dynamic_sampling,
        f"truncate_after={args.truncate_after}": args.truncate_after,
    }
    given = [name for name, value in unsupported.items() if value]
    if given:
        raise ValueError(
            f"rollout_func= does not go with {', '.join(given)}: the function makes the whole completion "
            "(a multi-turn episode included, with env_mask marking the tokens it inserted), so there is no "
            "builtin generation for tools, environments, dynamic sampling or truncate_after to act on. Drop them, or drop "
            "rollout_func."
        )
    return rollout_func


@dataclass
class UserRollout:
    """What a ``rollout_func`` returned, checked, in the order of the prompts it was given."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]] | None
    """Per completion token; NaN where the function gave None."""
    env_mask: list[list[bool]] | None
    extra: dict[str, list[Any]] = field(default_factory=dict)
    """The other keys, one value per completion (a value that was not a list repeated)."""


def read_rollout(
    output: Any, n: int, *, max_completion_length: int, vocab_size: int, copies: int = 1
) -> UserRollout:
    """Check what a ``rollout_func`` returned for ``n`` prompts (each given ``copies`` times) and read it.

    Raises:
        TypeError: not a dict; a row that is not a sequence; ids that are not integers.
        ValueError: a required key missing; a key with another number of rows than prompts; a row of
            ``logprobs`` or ``env_mask`` not as long as its completion; an empty prompt; a completion longer
            than ``max_completion_length``; a token id outside the vocabulary; an ``env_mask`` value other
            than 0/1; an extra key named like an argument the reward functions already get.
    """
    if not isinstance(output, Mapping):
        raise TypeError(
            f"rollout_func returned {type(output).__name__}; it must return a dict with the keys "
            f"{list(REQUIRED_KEYS)} (one list entry per prompt it was given), optionally {MASK_KEY!r} and "
            "fields for the reward functions."
        )
    missing = [key for key in REQUIRED_KEYS if key not in output]
    if missing:
        raise ValueError(
            f"rollout_func returned the keys {sorted(output)}; it must also return {missing} "
            f"(required: {list(REQUIRED_KEYS)}; logprobs may be None)."
        )
    prompt_ids = [
        _ids(row, "prompt_ids", i, vocab_size) for i, row in enumerate(_rows(output, "prompt_ids", n, copies))
    ]
    completion_ids = [
        _ids(row, "completion_ids", i, vocab_size)
        for i, row in enumerate(_rows(output, "completion_ids", n, copies))
    ]
    for i, ids in enumerate(prompt_ids):
        if not ids:
            raise ValueError(
                f"rollout_func returned an empty prompt_ids[{i}]; each prompt needs its token ids."
            )
    for i, ids in enumerate(completion_ids):
        if len(ids) > max_completion_length:
            raise ValueError(
                f"rollout_func returned completion_ids[{i}] of {len(ids)} tokens, more than "
                f"max_completion_length={max_completion_length} (response_length: the trainer's response columns). "
                "Generate at "
                "most max_completion_length tokens (e.g. max_new_tokens / max_tokens = "
                "trainer.args.max_completion_length; an episode's inserted tokens count too), or raise "
                "max_completion_length."
            )
    logprobs = None
    if output["logprobs"] is not None:
        logprobs = [
            _floats(row, i, len(completion_ids[i]))
            for i, row in enumerate(_rows(output, "logprobs", n, copies))
        ]
    env_mask = None
    if output.get(MASK_KEY) is not None:
        env_mask = [
            _mask(row, i, len(completion_ids[i])) for i, row in enumerate(_rows(output, MASK_KEY, n, copies))
        ]
    extra = {}
    for key, value in output.items():
        if key in REQUIRED_KEYS or key == MASK_KEY:
            continue
        if key in REWARD_FUNC_ARGS:
            raise ValueError(
                f"rollout_func returned a field {key!r}, but the reward functions already get {key}= from the "
                f"trainer (it passes {list(REWARD_FUNC_ARGS)}); rename the field."
            )
        if isinstance(value, list):  # TRL's rule: a list is one value per completion, anything else is shared
            if len(value) != n:
                raise ValueError(_count_message(key, len(value), n, copies))
            extra[key] = list(value)
        else:
            extra[key] = [value] * n
    return UserRollout(prompt_ids, completion_ids, logprobs, env_mask, extra)


def _count_message(key: str, got: int, n: int, copies: int) -> str:
    repeated = f", each prompt {copies} times in a row (num_generations)" if copies > 1 else ""
    return (
        f"rollout_func returned {got} entries in {key!r} for the {n} prompts it was given{repeated}; return "
        "exactly one per prompt given, in the same order (a field for the reward functions that is the same "
        "for every completion can be a non-list value)."
    )


def _rows(output: Mapping[str, Any], key: str, n: int, copies: int) -> list[Any]:
    value = output[key]
    if isinstance(value, torch.Tensor) or type(value).__module__ == "numpy":  # arrays: their rows
        value = value.tolist()
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise TypeError(
            f"rollout_func returned {key}={type(value).__name__}; it must be a list with one entry per prompt "
            "(each entry a list of numbers)."
        )
    if len(value) != n:
        raise ValueError(_count_message(key, len(value), n, copies))
    return list(value)


def _sequence(row: Any, key: str, i: int) -> list[Any]:
    if isinstance(row, torch.Tensor) or type(row).__module__ == "numpy":
        row = row.tolist()
    if not isinstance(row, Sequence) or isinstance(row, (str, bytes)):
        raise TypeError(
            f"rollout_func returned {key}[{i}] = {type(row).__name__}; it must be a list of numbers."
        )
    return list(row)


def _ids(row: Any, key: str, i: int, vocab_size: int) -> list[int]:
    values = _sequence(row, key, i)
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, numbers.Integral)]
    if bad:
        raise TypeError(
            f"rollout_func returned {key}[{i}] with non-integer ids (e.g. {bad[0]!r}); give token ids."
        )
    outside = [v for v in values if not 0 <= v < vocab_size]
    if outside:
        raise ValueError(
            f"rollout_func returned {key}[{i}] with the id {outside[0]}, outside the policy's vocabulary "
            f"(0..{vocab_size - 1}); tokenize with the trainer's processing_class."
        )
    return [int(v) for v in values]


def _floats(row: Any, i: int, length: int) -> list[float]:
    values = _sequence(row, "logprobs", i)
    if len(values) != length:
        raise ValueError(
            f"rollout_func returned logprobs[{i}] with {len(values)} values for a completion of {length} tokens; "
            "give one log-prob per completion token (or logprobs=None)."
        )
    try:
        return [float("nan") if v is None else float(v) for v in values]
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"rollout_func returned logprobs[{i}] with a value that is not a number: {err}"
        ) from None


def _mask(row: Any, i: int, length: int) -> list[bool]:
    values = _sequence(row, MASK_KEY, i)
    if len(values) != length:
        raise ValueError(
            f"rollout_func returned {MASK_KEY}[{i}] with {len(values)} values for a completion of {length} tokens; "
            "give one 0/1 per completion token (1: the policy wrote it, 0: it was inserted)."
        )
    bad = [v for v in values if v not in (0, 1)]
    if bad:
        raise ValueError(
            f"rollout_func returned {MASK_KEY}[{i}] with the value {bad[0]!r}; it holds 1 (a token the policy "
            "wrote) or 0 (a token inserted by an environment or tool)."
        )
    return [bool(v) for v in values]


class UserRolloutProducer(SingleTurnProducer):
    """Rollouts whose completions a user's ``rollout_func`` makes (see the module docstring).

    Rows keep the engine's layout (completion j of prompt i at row ``j * B + i``); the function sees the
    prompts in TRL's order (prompt i's ``copies`` completions at ``i * copies + j``), and its lists are
    reordered here. The rollout's log-probs follow ``rollout_logprobs``: ``'generation'`` takes the
    returned ``logprobs`` (the clipped ratio's denominator, no policy forward pass); ``'forward'`` and
    ``'auto'`` recompute them with the policy and keep the returned ones where the generation's log-probs
    are read (``use_vllm``'s importance sampling, RLOO's ``truncated_is_cap``), as TRL does. A completion
    found its stop token when its last token is one (the end-of-sequence token, or the chat template's
    end of turn).

    Args:
        engine: the trainer (its tokenizer, reward sources, passes, ``args``).
        rollout_func: ``rollout_func(prompts, trainer) -> dict``.
    """

    def __init__(self, engine: Any, rollout_func: RolloutFunc) -> None:
        super().__init__(engine)
        self.rollout_func = rollout_func
        self.stop_ids = turn_end_ids(engine.processing_class, list(engine.sampler.stop_ids))
        self.vocab_size = embedding_rows(engine.policy)
        self.context = context_length(engine.policy)

    def sample(
        self,
        batch: dict[str, Any],
        copies: int = 1,
        with_logprobs: bool = False,
        timings: dict[str, float] | None = None,
    ) -> SampledResponses:
        """``copies`` completions to each prompt of a collated ``batch``, from ``rollout_func`` (it gets
        each prompt ``copies`` times in a row), checked and laid out as the engine's rows."""
        timings = timings if timings is not None else defaultdict(float)
        engine = self.engine
        prompts, columns = self._prompts_and_columns(batch)
        B, N = len(prompts), len(prompts) * copies
        given = [copy.deepcopy(prompt) for prompt in prompts for _ in range(copies)]
        began = time.perf_counter()
        output = self.rollout_func(given, engine)
        timings["timing/generate"] += time.perf_counter() - began
        got = read_rollout(
            output,
            N,
            max_completion_length=engine.args.response_length,
            vocab_size=self.vocab_size,
            copies=copies,
        )
        order = [(r % B) * copies + r // B for r in range(N)]  # the function's index of engine row r
        self._check_context(got)
        logprobs = self._generation_logprobs(got)
        device = engine.accelerator.device
        pad = engine.processing_class.pad_token_id
        R = engine.args.response_length
        query, query_mask = _left_padded(
            [got.prompt_ids[u] for u in order], pad, batch["input_ids"].to(device)
        )
        response = torch.full((N, R), pad, dtype=torch.long, device=device)
        generation_logprobs = (
            None if logprobs is None else torch.zeros((N, R), dtype=torch.float32, device=device)
        )
        loss_mask = None if got.env_mask is None else torch.zeros((N, R), dtype=torch.bool, device=device)
        for r, u in enumerate(order):
            n = len(got.completion_ids[u])
            response[r, :n] = torch.tensor(got.completion_ids[u], dtype=torch.long)
            if generation_logprobs is not None:
                generation_logprobs[r, :n] = torch.tensor(logprobs[u], dtype=torch.float32)
            if loss_mask is not None:
                loss_mask[r, :n] = torch.tensor(got.env_mask[u], dtype=torch.bool)
        lengths = torch.tensor([len(got.completion_ids[u]) for u in order], dtype=torch.long, device=device)
        columns = {name: list(values) * copies for name, values in columns.items()}
        columns.update({name: [values[u] for u in order] for name, values in got.extra.items()})
        return SampledResponses(
            query=query,
            query_mask=query_mask,
            response=response,
            response_mask=torch.arange(R, device=device)[None, :] < lengths[:, None],
            lengths=lengths,
            prompts=list(prompts) * copies,
            columns=columns,
            generation_logprobs=generation_logprobs,
            loss_mask=loss_mask,
        )

    def _generation_logprobs(self, got: UserRollout) -> list[list[float]] | None:
        """The returned log-probs where the rollout reads them (``rollout_logprobs='generation'``, or the
        engine needs the generation's: vLLM's importance sampling, RLOO's ``truncated_is_cap``); None
        otherwise, so the policy's forward pass gives the rollout's."""
        engine = self.engine
        as_rollout = engine.args.rollout_logprobs == "generation"
        if not (as_rollout or engine.needs_generation_logprobs):
            return None
        if got.logprobs is None:
            if as_rollout:
                raise ValueError(
                    "rollout_logprobs='generation' takes the rollout's log-probs from rollout_func, but it "
                    "returned logprobs=None; return the completion tokens' log-probs, or set "
                    "rollout_logprobs='forward' (the policy's forward pass computes them)."
                )
            if engine.algorithm.needs_generation_logprobs:
                raise ValueError(
                    f"{type(engine).__name__}'s loss reads the generation's log-probs (truncated importance "
                    "sampling), but rollout_func returned logprobs=None; return the completion tokens' "
                    "log-probs, or turn the importance sampling off."
                )
            return None
        if as_rollout and any(v != v for row in got.logprobs for v in row):
            raise ValueError(
                "rollout_func returned a None/NaN log-prob, but rollout_logprobs='generation' takes its log-probs "
                "as the rollout's; give every completion token's log-prob, or set rollout_logprobs='forward'."
            )
        return got.logprobs

    def _check_context(self, got: UserRollout) -> None:
        if self.context is None:
            return
        for i, (prompt, completion) in enumerate(zip(got.prompt_ids, got.completion_ids, strict=True)):
            if len(prompt) + len(completion) > self.context:
                raise ValueError(
                    f"rollout_func returned prompt_ids[{i}] ({len(prompt)} tokens) and completion_ids[{i}] "
                    f"({len(completion)}): {len(prompt) + len(completion)} tokens, more than the policy's "
                    f"{self.context} positions (config.max_position_embeddings). Shorten the prompt."
                )

    def score(self, samples: SampledResponses, timings: dict[str, float] | None = None) -> Scores:
        """The single-turn scoring of the returned completions (extra fields among the columns); a
        completion found its stop token when its last token is one of :attr:`stop_ids`."""
        scores = super().score(samples, timings)
        last = samples.response.gather(1, (samples.lengths - 1).clamp_min(0)[:, None])[:, 0]
        stops = torch.tensor(self.stop_ids, dtype=torch.long, device=last.device)
        scores.found_stop = torch.isin(last, stops) & (samples.lengths > 0)
        return scores

    def assemble(self, samples: SampledResponses, scores: Scores, passes: ForwardPasses) -> Rollout:
        """The single-turn rollout; a None/NaN returned log-prob is replaced by the recomputed one (an
        importance ratio of 1 there: no correction, as TRL treats it)."""
        generation = samples.generation_logprobs
        if generation is not None and torch.isnan(generation).any():
            samples.generation_logprobs = torch.where(torch.isnan(generation), passes.logprobs, generation)
        return super().assemble(samples, scores, passes)
