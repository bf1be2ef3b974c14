"""Preferences on the policy's own samples, labelled by a rule: the reference implementation's labelling
with the hidden rule as the labeller.

lm-human-preferences collects its human labels on samples of the pretrained policy itself: for each
query it samples 4 continuations, and the labeller picks the best. A reward model trained on those
labels has seen the kind of text the policy writes, which is what keeps PPO from finding, in text the
reward model never saw, a score the labeller would not give. :func:`sample_groups` draws the samples
(token ids, exactly as the trainers' rollouts hold them), :func:`best_of_n_pairs` plays the labeller with
a rule, and :func:`on_policy_preferences` does both and returns a preference dataset in the tokenized
format of :class:`~rlhf_trainers.RewardTrainer` (``input_ids_chosen`` / ``input_ids_rejected``), so the
reward model scores, during training, the very tokens it will score during PPO and RLOO.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datasets
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class SampleGroup:
    """``n`` sampled responses of one prompt, as token ids.

    ``responses`` end at their first EOS (kept) or at the length limit (cut, no EOS), like the responses
    of a rollout; ``texts`` are their decoded texts without special tokens (what reward functions see).
    """

    prompt: Any
    prompt_ids: list[int]
    responses: list[list[int]]
    texts: list[str]


def sample_groups(
    policy: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Any],
    *,
    samples_per_prompt: int = 4,
    response_length: int,
    temperature: float = 1.0,
    batch_size: int = 64,
) -> list[SampleGroup]:
    """``samples_per_prompt`` completions of each prompt from ``policy``, sampled through the trainers'
    generation interface (:func:`rlhf_trainers.generation.sample_responses`: the builtin loop, the full
    distribution at ``temperature``, stop at EOS).

    The prompts are tokenized as the trainers tokenize them (:func:`rlhf_trainers.data.tokenize_prompts`:
    chat messages through the chat template with the generation prompt).
    """
    from datasets import Dataset

    from ..data import tokenize_prompts
    from ..generation import sample_responses

    if samples_per_prompt < 2:
        raise ValueError(
            f"samples_per_prompt={samples_per_prompt}: a labeller needs at least 2 to choose from."
        )
    tokenized, _ = tokenize_prompts(Dataset.from_dict({"prompt": list(prompts)}), tokenizer)
    prompt_ids = [list(ids) for ids in tokenized["input_ids"]]
    responses = sample_responses(
        policy,
        tokenizer,
        [ids for ids in prompt_ids for _ in range(samples_per_prompt)],
        response_length=response_length,
        temperature=temperature,
        batch_size=batch_size,
    )
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    n = samples_per_prompt
    return [
        SampleGroup(prompts[i], prompt_ids[i], responses[i * n : (i + 1) * n], texts[i * n : (i + 1) * n])
        for i in range(len(prompt_ids))
    ]


def best_of_n_pairs(
    groups: Sequence[SampleGroup], scores: Sequence[Sequence[float]]
) -> tuple[list[tuple[list[int], list[int]]], dict[str, int]]:
    """The labeller's choice as preference pairs: in each group the best response (highest score) is
    preferred to every response that scores strictly lower.

    A group whose highest score is shared by two or more responses gives no pairs (the labeller of the
    reference implementation picks one best; with a tie at the top the rule does not say which), and
    responses tied with each other below the best are each still paired with the best.

    Returns:
        ``(pairs, counts)``: pairs of full sequences (prompt ids + response ids) as ``(chosen,
        rejected)``, and counts ``groups``, ``groups_used``, ``groups_tied_at_top``, ``pairs``.
    """
    if len(groups) != len(scores):
        raise ValueError(f"{len(groups)} groups but {len(scores)} score lists.")
    pairs: list[tuple[list[int], list[int]]] = []
    tied = 0
    for group, group_scores in zip(groups, scores, strict=True):
        if len(group_scores) != len(group.responses):
            raise ValueError(f"a group of {len(group.responses)} responses has {len(group_scores)} scores.")
        best = max(range(len(group_scores)), key=lambda i: group_scores[i])
        if sum(score == group_scores[best] for score in group_scores) > 1:
            tied += 1
            continue
        chosen = group.prompt_ids + group.responses[best]
        for i, score in enumerate(group_scores):
            if score < group_scores[best]:
                pairs.append((chosen, group.prompt_ids + group.responses[i]))
    counts = {
        "groups": len(groups),
        "groups_used": len(groups) - tied,
        "groups_tied_at_top": tied,
        "pairs": len(pairs),
    }
    return pairs, counts


def on_policy_preferences(
    policy: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Any],
    rule: Callable[..., Sequence[float]],
    *,
    samples_per_prompt: int = 4,
    response_length: int,
    temperature: float = 1.0,
    batch_size: int = 64,
    swaps: Mapping[str, Sequence[str]] | None = None,
    seed: int = 0,
) -> tuple[datasets.Dataset, list[SampleGroup], dict[str, int]]:
    """Sample ``samples_per_prompt`` responses per prompt from ``policy``, let ``rule`` (called as a reward
    function: ``rule(prompts=..., completions=...)``) pick the best of each group, and return the pairs as
    a tokenized preference dataset (``input_ids_chosen`` / ``input_ids_rejected``), with the samples and
    the counts of :func:`best_of_n_pairs`. With ``swaps``, the minimal pairs of :func:`word_swap_pairs`
    on the same samples are added (counts ``best_of_n_pairs``, ``word_swap_pairs``, ``samples_edited``;
    ``pairs`` is the total)."""
    from datasets import Dataset

    groups = sample_groups(
        policy,
        tokenizer,
        prompts,
        samples_per_prompt=samples_per_prompt,
        response_length=response_length,
        temperature=temperature,
        batch_size=batch_size,
    )
    scores = [list(rule(prompts=[g.prompt] * len(g.texts), completions=g.texts)) for g in groups]
    pairs, counts = best_of_n_pairs(groups, scores)
    if swaps is not None:
        swapped, swap_counts = word_swap_pairs(groups, tokenizer, rule, swaps, seed=seed)
        counts = {
            **counts,
            "best_of_n_pairs": len(pairs),
            "word_swap_pairs": len(swapped),
            "samples_edited": swap_counts["samples_edited"],
            "pairs": len(pairs) + len(swapped),
        }
        pairs = pairs + swapped
    dataset = Dataset.from_dict(
        {"input_ids_chosen": [c for c, _ in pairs], "input_ids_rejected": [r for _, r in pairs]}
    )
    return dataset, groups, counts


def sequences(groups: Sequence[SampleGroup]) -> list[list[int]]:
    """Every sampled sequence (prompt ids + response ids) of ``groups``, group by group."""
    return [g.prompt_ids + r for g in groups for r in g.responses]


def right_padded(rows: Sequence[Sequence[int]], pad_token_id: int) -> torch.Tensor:
    """(N, longest) token ids, each row followed by padding."""
    import torch

    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(list(row))
    return out


def word_swap_pairs(
    groups: Sequence[SampleGroup],
    tokenizer: PreTrainedTokenizerBase,
    rule: Callable[..., Sequence[float]],
    swaps: Mapping[str, Sequence[str]],
    *,
    seed: int = 0,
) -> tuple[list[tuple[list[int], list[int]]], dict[str, int]]:
    """Minimal pairs on the policy's own samples: each sample that holds a word of ``swaps`` (matched
    lower-case, as a whole word) against a copy with one such word, picked at random, replaced by a
    random word of ``swaps[word]``; ``rule`` labels the pair (the higher-scoring side is chosen; a swap
    the rule scores the same gives no pair).

    The two sides differ in one word, so the pair teaches what the rule rewards and nothing else; the
    text around it is the policy's own. The sample keeps its token ids; the edited copy is its text with
    the swap, tokenized again, with the EOS kept when the sample ended with one.

    Returns:
        ``(pairs, counts)`` as :func:`best_of_n_pairs`: pairs of full sequences (prompt ids + response
        ids), and counts ``samples``, ``samples_edited``, ``pairs``.
    """
    import random
    import re

    rng = random.Random(seed)
    eos = tokenizer.eos_token_id
    pairs: list[tuple[list[int], list[int]]] = []
    samples = edited = 0
    for group in groups:
        for response, text in zip(group.responses, group.texts, strict=True):
            samples += 1
            spots = [m for m in re.finditer(r"[A-Za-z]+", text) if m.group().lower() in swaps]
            if not spots:
                continue
            spot = rng.choice(spots)
            new_word = rng.choice(list(swaps[spot.group().lower()]))
            if spot.group()[0].isupper():
                new_word = new_word[0].upper() + new_word[1:]
            new_text = text[: spot.start()] + new_word + text[spot.end() :]
            new_response = tokenizer(new_text, add_special_tokens=False)["input_ids"]
            if response and response[-1] == eos:
                new_response = [*new_response, eos]
            original, swapped = rule(prompts=[group.prompt] * 2, completions=[text, new_text])
            if original == swapped:
                continue
            edited += 1
            sample_ids, swapped_ids = group.prompt_ids + list(response), group.prompt_ids + new_response
            pairs.append((sample_ids, swapped_ids) if original > swapped else (swapped_ids, sample_ids))
    return pairs, {"samples": samples, "samples_edited": edited, "pairs": len(pairs)}
