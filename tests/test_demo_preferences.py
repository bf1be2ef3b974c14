"""The demo's on-distribution preference builder: the policy's own samples, labelled best-of-n by a rule
(the reference implementation's labelling, with the hidden rule as the labeller)."""

from __future__ import annotations

import pytest
import torch

from rlhf_trainers.demo.preferences import SampleGroup, best_of_n_pairs, on_policy_preferences, sample_groups
from rlhf_trainers.testing import true_reward


def _group(prompt_ids: list[int], responses: list[list[int]]) -> SampleGroup:
    return SampleGroup(prompt="p", prompt_ids=prompt_ids, responses=responses, texts=[""] * len(responses))


def test_best_of_four_is_preferred_to_every_lower_response():
    group = _group([1, 2], [[10], [11, 3], [12], [13, 3]])
    pairs, counts = best_of_n_pairs([group], [[0.1, 0.9, -0.5, 0.1]])
    # The best (index 1) against each of the three others, the prompt in front of every sequence.
    assert pairs == [([1, 2, 11, 3], [1, 2, 10]), ([1, 2, 11, 3], [1, 2, 12]), ([1, 2, 11, 3], [1, 2, 13, 3])]
    assert counts == {"groups": 1, "groups_used": 1, "groups_tied_at_top": 0, "pairs": 3}


def test_a_tie_at_the_top_gives_no_pairs_and_ties_below_still_pair_with_the_best():
    tied_top = _group([1], [[10], [11], [12], [13]])
    tied_below = _group([2], [[20], [21], [22], [23]])
    pairs, counts = best_of_n_pairs([tied_top, tied_below], [[0.5, 0.5, 0.0, 0.1], [0.0, 0.0, 0.7, 0.0]])
    assert pairs == [([2, 22], [2, 20]), ([2, 22], [2, 21]), ([2, 22], [2, 23])]
    assert counts == {"groups": 2, "groups_used": 1, "groups_tied_at_top": 1, "pairs": 3}


def test_mismatched_scores_are_refused():
    with pytest.raises(ValueError, match="2 groups but 1 score lists"):
        best_of_n_pairs([_group([1], [[2], [3]]), _group([1], [[2], [3]])], [[0.0, 1.0]])
    with pytest.raises(ValueError, match="a group of 2 responses has 3 scores"):
        best_of_n_pairs([_group([1], [[2], [3]])], [[0.0, 1.0, 2.0]])


def test_samples_are_the_policys_own_token_ids_cut_like_rollouts(kit):
    tokenizer = kit.load_tokenizer()
    policy = kit.load_model("llama-sft").eval()
    prompts = list(kit.prompt_dataset("train", n=6)["prompt"])
    torch.manual_seed(0)
    groups = sample_groups(policy, tokenizer, prompts, samples_per_prompt=4, response_length=12, batch_size=8)
    assert len(groups) == 6
    eos = tokenizer.eos_token_id
    for group, prompt in zip(groups, prompts, strict=True):
        assert group.prompt == prompt
        assert group.prompt_ids == tokenizer(prompt)["input_ids"]  # as the trainers tokenize a text prompt
        assert len(group.responses) == 4 and len(group.texts) == 4
        for response, text in zip(group.responses, group.texts, strict=True):
            assert 1 <= len(response) <= 12
            assert tokenizer.pad_token_id not in response
            # Ends at its first EOS (kept) or runs to the length limit without one.
            assert eos not in response[:-1]
            assert response[-1] == eos or len(response) == 12
            assert text == tokenizer.decode(response, skip_special_tokens=True)


def test_on_policy_preferences_label_with_the_rule(kit):
    tokenizer = kit.load_tokenizer()
    policy = kit.load_model("llama-sft").eval()
    prompts = list(kit.prompt_dataset("train", n=16)["prompt"])
    torch.manual_seed(0)
    dataset, groups, counts = on_policy_preferences(
        policy, tokenizer, prompts, true_reward, samples_per_prompt=4, response_length=12
    )
    assert counts["groups"] == 16 and counts["pairs"] == len(dataset) > 0
    assert counts["groups_used"] + counts["groups_tied_at_top"] == 16
    by_sequence = {}
    for group in groups:
        for response, text in zip(group.responses, group.texts, strict=True):
            by_sequence[tuple(group.prompt_ids + response)] = true_reward(None, [text])[0]
    for chosen, rejected in zip(dataset["input_ids_chosen"], dataset["input_ids_rejected"], strict=True):
        # Both are samples of the same prompt, and the rule scores the chosen strictly higher.
        assert by_sequence[tuple(chosen)] > by_sequence[tuple(rejected)]
    # Every used group contributes its best against each strictly lower response.
    expected = 0
    for group in groups:
        scores = true_reward(None, group.texts)
        if scores.count(max(scores)) == 1:
            expected += sum(s < max(scores) for s in scores)
    assert counts["pairs"] == expected


def test_word_swaps_pair_a_sample_with_a_one_word_edit_labelled_by_the_rule(kit):
    from rlhf_trainers.demo.preferences import word_swap_pairs

    tokenizer = kit.load_tokenizer()
    eos = tokenizer.eos_token_id
    texts = [" really bright .", " quite dull .", " a plain table ."]
    responses = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    responses[0] = [*responses[0], eos]  # ended with EOS: the edit keeps it; the second was cut off
    group = SampleGroup(prompt="the movie was", prompt_ids=[5, 6], responses=responses, texts=texts)
    swaps = {"bright": ["dull"], "dull": ["bright"]}
    pairs, counts = word_swap_pairs([group], tokenizer, true_reward, swaps, seed=0)
    assert counts == {"samples": 3, "samples_edited": 2, "pairs": 2}  # nothing to swap in the third
    edited_bright = [5, 6, *tokenizer(" really dull .", add_special_tokens=False)["input_ids"], eos]
    edited_dull = [5, 6, *tokenizer(" quite bright .", add_special_tokens=False)["input_ids"]]
    # The sample keeps its own ids; the rule prefers the positive side either way.
    assert pairs == [([5, 6, *responses[0]], edited_bright), (edited_dull, [5, 6, *responses[1]])]


def test_a_swap_the_rule_scores_the_same_gives_no_pair(kit):
    from rlhf_trainers.demo.preferences import word_swap_pairs

    tokenizer = kit.load_tokenizer()
    group = SampleGroup(prompt="p", prompt_ids=[1], responses=[[7]], texts=[" bright ."])
    pairs, counts = word_swap_pairs([group], tokenizer, true_reward, {"bright": ["warm"]})
    assert pairs == [] and counts == {"samples": 1, "samples_edited": 0, "pairs": 0}
