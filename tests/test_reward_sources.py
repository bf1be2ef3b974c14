"""rlhf_trainers.rewards: the reward model (policy token ids or re-tokenized text), reward functions and
sources of one's own behind the RewardSource protocol, weighted by RewardSources."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

from rlhf_trainers import functional as F
from rlhf_trainers.generation import render_prompts
from rlhf_trainers.models import get_reward_normalization, set_reward_normalization
from rlhf_trainers.rewards import (
    RewardBatch,
    RewardFunctionSource,
    RewardModelSource,
    RewardSource,
    RewardSources,
    join_prompt_completion,
    rlvr,
    score_ids,
    score_texts,
)
from rlhf_trainers.testing import true_reward

PROMPTS = [
    "the movie was",
    "honestly , the dinner is",
    "we found the room",
    "i think the song is",
    "my city was",
]
COMPLETIONS = [
    " good .",
    " pretty bright and simple .",
    " really awful but quite warm and kind .",
    "",  # the policy stopped at once: only EOS
    " calm",  # did not stop: no EOS
]
UNFINISHED = " calm"


@pytest.fixture(scope="module")
def tok(kit):
    return kit.load_tokenizer()


@pytest.fixture(scope="module")
def alt(kit):
    return kit.load_tokenizer("alt")


@pytest.fixture(scope="module")
def llama(kit):
    return kit.load_model("llama-seqcls")


@pytest.fixture(scope="module")
def gpt2(kit):
    return kit.load_model("gpt2-seqcls")


@pytest.fixture(scope="module")
def gpt2_alt(kit):
    return kit.load_model("gpt2-alt-seqcls")


def rollout(tokenizer, prompts, completions, *, stopped=None, extra_right=2):
    """``query_response_ids`` as a rollout makes them, and the decoded completions.

    Prompts (rendered, chat ones with the generation prompt) left-padded to a common width, each
    response followed by EOS when it stopped (all but ``UNFINISHED`` by default) and right-padded.
    """
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    stopped = [c != UNFINISHED for c in completions] if stopped is None else stopped
    query = tokenizer(
        render_prompts(prompts, tokenizer), return_tensors="pt", padding=True, padding_side="left"
    )
    responses = [
        tokenizer(c)["input_ids"] + ([eos] if s else []) for c, s in zip(completions, stopped, strict=True)
    ]
    width = max(len(r) for r in responses) + extra_right
    response = torch.full((len(responses), width), pad)
    for row, ids in enumerate(responses):
        response[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    decoded = tokenizer.batch_decode(response, skip_special_tokens=True)
    return torch.cat([query["input_ids"], response], dim=1), decoded


def alone(model, ids, pad):
    """The model's score of each row with its padding removed, one row per forward pass."""
    scores = []
    with torch.no_grad():
        for row in ids:
            real = row[row != pad].unsqueeze(0)
            scores.append(model(input_ids=real).logits[0, 0].item())
    return torch.tensor(scores)


def fresh(kit, name):
    """A model of its own, for tests that change its config."""
    return kit.load_model(name)


# --------------------------------------------------------------------------------------------------
# The reward model on the policy's token ids
# --------------------------------------------------------------------------------------------------


def test_rollout_helper_builds_what_a_rollout_builds(tok):
    ids, decoded = rollout(tok, PROMPTS, COMPLETIONS)
    assert decoded == COMPLETIONS
    assert (ids[:, 0] == tok.pad_token_id).any() and (ids[:, -1] == tok.pad_token_id).all()
    assert (ids[:, :-2] != tok.pad_token_id).all(dim=1).sum() == 0  # every row is padded somewhere


@pytest.mark.parametrize("model_name", ["llama", "gpt2"])
def test_id_path_equals_text_path(request, tok, model_name):
    model = request.getfixturevalue(model_name)
    ids, decoded = rollout(tok, PROMPTS[:4], COMPLETIONS[:4])  # all stopped: the text path appends EOS too
    sources = RewardSources(policy_tokenizer=tok, reward_model=model)
    assert sources.same_tokenizer and sources.names == ["reward_model"] and sources.weights == [1.0]
    total, per_source = sources(query_response_ids=ids, prompts=PROMPTS[:4], completions=decoded)
    texts = [p + c for p, c in zip(PROMPTS[:4], COMPLETIONS[:4], strict=True)]
    expected = score_texts(model, tok, texts)
    assert per_source["reward_model"].dtype == torch.float32
    assert per_source["reward_model"].device.type == "cpu"
    torch.testing.assert_close(per_source["reward_model"], expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(total, expected, rtol=0, atol=1e-5)
    assert len(set(expected.tolist())) == 4  # the rows really differ


@pytest.mark.parametrize("model_name", ["llama", "gpt2"])
def test_padded_batch_scores_equal_each_sequence_alone(request, tok, model_name):
    model = request.getfixturevalue(model_name)
    ids, decoded = rollout(tok, PROMPTS, COMPLETIONS, extra_right=3)
    expected = alone(model, ids, tok.pad_token_id)
    for batch_size in (1, 2, 64):
        sources = RewardSources(policy_tokenizer=tok, reward_model=model, batch_size=batch_size)
        _, per_source = sources(query_response_ids=ids, prompts=PROMPTS, completions=decoded)
        torch.testing.assert_close(per_source["reward_model"], expected, rtol=0, atol=1e-5)


def test_gpt2_needs_the_position_ids_that_score_ids_passes(tok, gpt2):
    """The check above is sensitive: GPT-2's absolute positions make left padding matter without them."""
    ids, _ = rollout(tok, PROMPTS, COMPLETIONS)
    mask = (ids != tok.pad_token_id).long()
    with torch.no_grad():
        without = gpt2(input_ids=ids, attention_mask=mask).logits[:, 0]
    assert not torch.allclose(without, alone(gpt2, ids, tok.pad_token_id), atol=1e-3)


def test_score_is_read_at_the_last_non_pad_token(tok, llama):
    """Appending padding changes nothing; appending a real token changes the score."""
    ids, decoded = rollout(tok, PROMPTS, COMPLETIONS, extra_right=0)
    sources = RewardSources(policy_tokenizer=tok, reward_model=llama)
    base = sources(query_response_ids=ids, prompts=PROMPTS, completions=decoded)[0]
    padded = torch.cat([ids, torch.full((len(PROMPTS), 5), tok.pad_token_id)], dim=1)
    torch.testing.assert_close(
        sources(query_response_ids=padded, prompts=PROMPTS, completions=decoded)[0], base
    )
    longer = torch.cat([ids, torch.full((len(PROMPTS), 1), tok.eos_token_id)], dim=1)
    assert not torch.allclose(
        sources(query_response_ids=longer, prompts=PROMPTS, completions=decoded)[0], base
    )


def test_max_length_keeps_the_end_like_score_texts(tok, llama, gpt2):
    ids, decoded = rollout(tok, PROMPTS[:4], COMPLETIONS[:4])
    texts = [p + c for p, c in zip(PROMPTS[:4], COMPLETIONS[:4], strict=True)]
    for model in (llama, gpt2):
        for max_length in (3, 6, 100):
            sources = RewardSources(policy_tokenizer=tok, reward_model=model, max_length=max_length)
            _, per_source = sources(query_response_ids=ids, prompts=PROMPTS[:4], completions=decoded)
            expected = score_texts(model, tok, texts, max_length=max_length)
            torch.testing.assert_close(per_source["reward_model"], expected, rtol=0, atol=1e-5)


def test_normalization_is_applied_on_both_paths(kit, tok, alt):
    ids, decoded = rollout(tok, PROMPTS, COMPLETIONS)
    for name, reward_tokenizer in (("llama-seqcls", None), ("gpt2-alt-seqcls", alt)):
        model = fresh(kit, name)
        sources = RewardSources(policy_tokenizer=tok, reward_model=model, reward_tokenizer=reward_tokenizer)
        raw = sources(query_response_ids=ids, prompts=PROMPTS, completions=decoded)[1]["reward_model"]
        set_reward_normalization(model, 2.5, -0.75)
        assert get_reward_normalization(model) == (2.5, -0.75)
        total, per_source = sources(query_response_ids=ids, prompts=PROMPTS, completions=decoded)
        torch.testing.assert_close(per_source["reward_model"], raw * 2.5 - 0.75)
        torch.testing.assert_close(total, raw * 2.5 - 0.75)


def test_score_ids_normalize_false_and_empty_batch(tok, llama):
    ids, _ = rollout(tok, PROMPTS, COMPLETIONS)
    model = copy.deepcopy(llama)
    set_reward_normalization(model, 3.0, 1.0)
    raw = score_ids(model, ids, tok.pad_token_id, normalize=False)
    torch.testing.assert_close(score_ids(model, ids, tok.pad_token_id), raw * 3.0 + 1.0)
    assert score_ids(model, ids[:0], tok.pad_token_id).shape == (0,)
    sources = RewardSources(policy_tokenizer=tok, reward_model=model, reward_funcs=true_reward)
    total, per_source = sources(query_response_ids=ids[:0], prompts=[], completions=[])
    assert total.shape == (0,) and all(v.shape == (0,) for v in per_source.values())


def test_reward_model_pad_id_is_aligned_at_construction(kit, tok):
    model = fresh(kit, "gpt2-seqcls")
    model.config.pad_token_id = None  # would refuse batches; another id would pool at the wrong token
    ids, decoded = rollout(tok, PROMPTS, COMPLETIONS)
    sources = RewardSources(policy_tokenizer=tok, reward_model=model)
    assert model.config.pad_token_id == tok.pad_token_id
    _, per_source = sources(query_response_ids=ids, prompts=PROMPTS, completions=decoded)
    torch.testing.assert_close(
        per_source["reward_model"], alone(model, ids, tok.pad_token_id), rtol=0, atol=1e-5
    )
    model.config.pad_token_id = tok.eos_token_id  # changed behind our back: refused, not silently wrong
    with pytest.raises(ValueError, match=r"pools at config.pad_token_id=0.*padded with 1.*align_pad_token"):
        sources(query_response_ids=ids, prompts=PROMPTS, completions=decoded)


def test_score_ids_refuses_per_token_logits(kit, tok):
    causal = kit.load_model("llama")
    causal.config.pad_token_id = tok.pad_token_id
    ids, _ = rollout(tok, PROMPTS, COMPLETIONS)
    with pytest.raises(ValueError, match=r"pooled logits of shape \(batch, 1\).*got shape \(5, \d+, 627\)"):
        score_ids(causal, ids, tok.pad_token_id)
    with pytest.raises(ValueError, match=r"\(batch, length\)"):
        score_ids(causal, ids[0], tok.pad_token_id)


def test_eval_mode_during_scoring_and_mode_restored(tok, gpt2):
    """gpt2-seqcls keeps GPT-2's dropout: scores in train mode would be random."""
    model = copy.deepcopy(gpt2)
    ids, decoded = rollout(tok, PROMPTS, COMPLETIONS)
    sources = RewardSources(policy_tokenizer=tok, reward_model=model)
    expected = sources(query_response_ids=ids, prompts=PROMPTS, completions=decoded)[0]
    model.train()
    torch.manual_seed(0)
    with torch.no_grad():  # the check is sensitive: dropout is active in train mode
        mask = (ids != tok.pad_token_id).long()
        kwargs = {"input_ids": ids, "attention_mask": mask, "position_ids": F.position_ids_from_mask(mask)}
        assert not torch.allclose(model(**kwargs).logits, model(**kwargs).logits)
    for _ in range(2):
        total, per_source = sources(query_response_ids=ids, prompts=PROMPTS, completions=decoded)
        torch.testing.assert_close(total, expected)
        assert not total.requires_grad and not per_source["reward_model"].requires_grad
    assert model.training


def test_zero3_gather_only_without_a_forward(tok, llama, monkeypatch):
    """Without reward_model_forward the weights are gathered (``distributed.gathered``), with it they are
    not."""
    import contextlib

    import rlhf_trainers.rewards.model as reward_model_module

    gathered = []

    def spy(*models, modify=False):
        assert not modify
        gathered.append(models)
        return contextlib.nullcontext()

    monkeypatch.setattr(reward_model_module, "gathered", spy)
    ids, decoded = rollout(tok, PROMPTS, COMPLETIONS)
    sources = RewardSources(policy_tokenizer=tok, reward_model=llama)
    sources(query_response_ids=ids, prompts=PROMPTS, completions=decoded)
    assert gathered == [(llama,)]
    sources(query_response_ids=ids, prompts=PROMPTS, completions=decoded, reward_model_forward=llama)
    assert gathered == [(llama,)]


@pytest.mark.parametrize("reward_tokenizer", [None, "alt"])
def test_reward_model_forward_replaces_the_model_call(request, tok, llama, gpt2_alt, reward_tokenizer):
    model = gpt2_alt if reward_tokenizer else llama
    calls = []

    def forward(**kwargs):
        calls.append(sorted(kwargs))
        return model(**kwargs)

    ids, decoded = rollout(tok, PROMPTS, COMPLETIONS)
    sources = RewardSources(
        policy_tokenizer=tok,
        reward_model=model,
        reward_tokenizer=request.getfixturevalue("alt") if reward_tokenizer else None,
        batch_size=2,
    )
    expected = sources(query_response_ids=ids, prompts=PROMPTS, completions=decoded)[0]
    got = sources(query_response_ids=ids, prompts=PROMPTS, completions=decoded, reward_model_forward=forward)[
        0
    ]
    torch.testing.assert_close(got, expected)
    assert len(calls) == 3  # 5 rows in batches of 2
    if reward_tokenizer is None:
        assert calls[0] == ["attention_mask", "input_ids", "position_ids"]


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_peft_reward_model_on_the_id_path(tok, llama):
    from peft import LoraConfig, TaskType, get_peft_model

    peft_model = get_peft_model(
        copy.deepcopy(llama),
        LoraConfig(
            task_type=TaskType.SEQ_CLS, r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False
        ),
    )
    ids, decoded = rollout(tok, PROMPTS, COMPLETIONS)
    sources = RewardSources(policy_tokenizer=tok, reward_model=peft_model)
    _, per_source = sources(query_response_ids=ids, prompts=PROMPTS, completions=decoded)
    merged = copy.deepcopy(peft_model).merge_and_unload()
    torch.testing.assert_close(
        per_source["reward_model"], alone(merged, ids, tok.pad_token_id), rtol=0, atol=1e-5
    )
    base = alone(llama, ids, tok.pad_token_id)
    assert not torch.allclose(per_source["reward_model"], base, atol=1e-4)  # the adapter counts


# --------------------------------------------------------------------------------------------------
# A reward model with another tokenizer: re-tokenized text
# --------------------------------------------------------------------------------------------------


def test_same_tokenizer_detection(kit, tok, alt):
    llama_copy = fresh(kit, "llama-seqcls")
    assert RewardSources(
        policy_tokenizer=tok, reward_model=llama_copy, reward_tokenizer=kit.load_tokenizer()
    ).same_tokenizer
    assert RewardSources(policy_tokenizer=tok, reward_model=llama_copy, reward_tokenizer=tok).same_tokenizer
    assert not RewardSources(
        policy_tokenizer=tok, reward_model=fresh(kit, "gpt2-alt-seqcls"), reward_tokenizer=alt
    ).same_tokenizer
    # the same vocabulary with another pad id: the policy's padding would be read as text
    other_pad = kit.load_tokenizer()
    other_pad.pad_token = other_pad.eos_token
    assert other_pad.get_vocab() == tok.get_vocab() and other_pad.pad_token_id != tok.pad_token_id
    sources = RewardSources(policy_tokenizer=tok, reward_model=llama_copy, reward_tokenizer=other_pad)
    assert not sources.same_tokenizer
    assert (
        llama_copy.config.pad_token_id == other_pad.pad_token_id
    )  # aligned with the tokenizer it scores with
    # reward functions only: same_tokenizer is True (nothing to re-tokenize)
    assert RewardSources(policy_tokenizer=tok, reward_funcs=true_reward).same_tokenizer


def test_other_tokenizer_scores_the_retokenized_text(tok, alt, gpt2_alt):
    ids, decoded = rollout(tok, PROMPTS, COMPLETIONS)
    sources = RewardSources(policy_tokenizer=tok, reward_model=gpt2_alt, reward_tokenizer=alt, batch_size=2)
    assert not sources.same_tokenizer
    total, per_source = sources(query_response_ids=ids, prompts=PROMPTS, completions=decoded)
    texts = [p + c for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
    torch.testing.assert_close(
        per_source["reward_model"], score_texts(gpt2_alt, alt, texts), rtol=0, atol=1e-5
    )
    # by hand: the alternative tokenizer's ids of the text, EOS appended (also to the row that did not stop)
    by_hand = []
    with torch.no_grad():
        for text in texts:
            x = torch.tensor([alt(text)["input_ids"] + [alt.eos_token_id]])
            by_hand.append(gpt2_alt(input_ids=x).logits[0, 0].item())
    torch.testing.assert_close(per_source["reward_model"], torch.tensor(by_hand), rtol=0, atol=1e-5)
    assert [len(alt(t)["input_ids"]) for t in texts] != [len(tok(t)["input_ids"]) for t in texts]
    # the policy's ids are not read on this path
    garbage = torch.full_like(ids, 5)
    torch.testing.assert_close(
        sources(query_response_ids=garbage, prompts=PROMPTS, completions=decoded)[0], total
    )


def test_other_tokenizer_with_chat_prompts_and_max_length(tok, alt, gpt2_alt):
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    ids, decoded = rollout(tok, chats, COMPLETIONS)
    assert decoded == COMPLETIONS
    sources = RewardSources(policy_tokenizer=tok, reward_model=gpt2_alt, reward_tokenizer=alt, max_length=7)
    _, per_source = sources(query_response_ids=ids, prompts=chats, completions=decoded)
    texts = [join_prompt_completion(p, c, alt) for p, c in zip(chats, COMPLETIONS, strict=True)]
    assert texts[0] == "<|user|>the movie was\n<|assistant|>good .\n"
    expected = score_texts(gpt2_alt, alt, texts, max_length=7)
    torch.testing.assert_close(per_source["reward_model"], expected, rtol=0, atol=1e-5)
    assert not torch.allclose(expected, score_texts(gpt2_alt, alt, texts), atol=1e-4)


# --------------------------------------------------------------------------------------------------
# Reward functions, weights and names
# --------------------------------------------------------------------------------------------------


def test_true_reward_as_a_reward_function(tok):
    ids, decoded = rollout(tok, PROMPTS, COMPLETIONS)
    sources = RewardSources(policy_tokenizer=tok, reward_funcs=true_reward)
    assert sources.names == ["true_reward"] and sources.weights == [1.0]
    total, per_source = sources(
        query_response_ids=ids, prompts=PROMPTS, completions=decoded, columns={"id": [0] * 5}
    )
    expected = torch.tensor(true_reward(PROMPTS, COMPLETIONS), dtype=torch.float32)
    assert per_source["true_reward"].dtype == torch.float32
    torch.testing.assert_close(per_source["true_reward"], expected)
    torch.testing.assert_close(total, expected)


def test_columns_are_passed_through(tok):
    received = {}

    def with_kwargs(prompts, completions, **kwargs):
        received["with_kwargs"] = (prompts, completions, kwargs)
        return [float(x) for x in kwargs["label"]]

    def named(completions, label, prompts, scale=None):
        received["named"] = (prompts, completions, label, scale)
        return [s * len(c) for s, c in zip(scale, completions, strict=True)]

    def only_kwargs(**kwargs):
        received["only_kwargs"] = kwargs
        return [0.0] * len(kwargs["completions"])

    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    ids, decoded = rollout(tok, chats, COMPLETIONS)
    columns = {"label": (1, 2, 3, 4, 5), "source": ["a", "b", "c", "d", "e"], "scale": [9] * 5}
    sources = RewardSources(policy_tokenizer=tok, reward_funcs=[with_kwargs, named, only_kwargs])
    _, per_source = sources(query_response_ids=ids, prompts=chats, completions=decoded, columns=columns)
    prompts, completions, kwargs = received["with_kwargs"]
    # TRL's convention: conversational prompts as given, each completion as an assistant message
    messages = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    assert prompts == chats and completions == messages
    extra = {"trainer_state", "log_extra", "log_metric"}  # (no completion_ids: no prompt_width given)
    assert {k: v for k, v in kwargs.items() if k not in extra} == {
        "label": [1, 2, 3, 4, 5],
        "source": ["a", "b", "c", "d", "e"],
        "scale": [9] * 5,
    }
    assert extra <= set(kwargs) and kwargs["trainer_state"] is None  # no trainer here
    assert isinstance(kwargs["label"], list)  # columns arrive as lists
    # a function without **kwargs gets only the columns it names
    assert received["named"] == (chats, messages, [1, 2, 3, 4, 5], [9] * 5)
    assert set(received["only_kwargs"]) == {"prompts", "completions", "label", "source", "scale"} | extra
    torch.testing.assert_close(per_source["with_kwargs"], torch.tensor([1.0, 2, 3, 4, 5]))
    torch.testing.assert_close(per_source["named"], torch.tensor([9.0] * 5))  # len() of a one-message list
    assert per_source["only_kwargs"].tolist() == [0.0] * 5
    # a required parameter that is not a column: refused before any function runs
    received.clear()
    with pytest.raises(
        ValueError, match=r"'named' requires the argument\(s\) \['label'\].*columns: \['source'\]"
    ):
        sources(query_response_ids=ids, prompts=chats, completions=decoded, columns={"source": list("abcde")})
    assert received == {}


def test_functions_get_their_own_lists(tok):
    def mutating(prompts, completions, **kwargs):
        completions.clear()
        kwargs["tag"].clear()
        return [1.0] * len(prompts)

    def reader(prompts, completions, tag):
        return [float(len(completions) + len(tag))] * len(prompts)

    ids, decoded = rollout(tok, PROMPTS, COMPLETIONS)
    tag = ["x"] * 5
    sources = RewardSources(policy_tokenizer=tok, reward_funcs=[mutating, reader])
    _, per_source = sources(
        query_response_ids=ids, prompts=PROMPTS, completions=decoded, columns={"tag": tag}
    )
    assert per_source["reader"].tolist() == [10.0] * 5 and tag == ["x"] * 5 and decoded == COMPLETIONS


def test_weights_combine_and_sources_are_in_order(tok, llama):
    ids, decoded = rollout(tok, PROMPTS, COMPLETIONS)

    def length(prompts, completions, **kwargs):
        return [len(c) for c in completions]  # ints are fine

    sources = RewardSources(
        policy_tokenizer=tok,
        reward_model=llama,
        reward_funcs=[true_reward, length],
        reward_weights=(2, -0.5, 0.0),
    )
    assert sources.names == ["reward_model", "true_reward", "length"]
    assert sources.weights == [2.0, -0.5, 0.0] and all(type(w) is float for w in sources.weights)
    total, per_source = sources(query_response_ids=ids, prompts=PROMPTS, completions=decoded)
    assert list(per_source) == sources.names
    expected = 2 * per_source["reward_model"] - 0.5 * per_source["true_reward"]
    torch.testing.assert_close(total, expected)
    assert total.dtype == torch.float32 and total.shape == (5,)
    torch.testing.assert_close(per_source["length"], torch.tensor([float(len(c)) for c in COMPLETIONS]))
    alone_rm = RewardSources(policy_tokenizer=tok, reward_model=llama)(
        query_response_ids=ids, prompts=PROMPTS, completions=decoded
    )[0]
    torch.testing.assert_close(per_source["reward_model"], alone_rm)
    assert "reward_model=2" in repr(sources) and "same_tokenizer=True" in repr(sources)


def test_names_are_unique(tok, llama):
    class Scorer:
        def __call__(self, prompts, completions, **kwargs):
            return [0.0] * len(prompts)

    def reward_model(prompts, completions, **kwargs):
        return [0.0] * len(prompts)

    def scaled(prompts, completions, factor=1.0, **kwargs):
        return [factor] * len(prompts)

    def true_reward_2(prompts, completions, **kwargs):
        return [0.0] * len(prompts)

    funcs = [
        true_reward,
        true_reward,
        true_reward_2,
        true_reward,
        lambda prompts, completions, **kw: [0.0] * len(prompts),
        lambda prompts, completions, **kw: [1.0] * len(prompts),
        Scorer(),
        functools.partial(scaled, factor=3.0),
        reward_model,
    ]
    sources = RewardSources(policy_tokenizer=tok, reward_model=llama, reward_funcs=funcs)
    assert sources.names == [
        "reward_model",
        "true_reward",
        "true_reward_2",
        "true_reward_2_2",
        "true_reward_3",
        "<lambda>",
        "<lambda>_2",
        "Scorer",
        "scaled",
        "reward_model_2",
    ]
    ids, decoded = rollout(tok, PROMPTS, COMPLETIONS)
    _, per_source = sources(query_response_ids=ids, prompts=PROMPTS, completions=decoded)
    assert list(per_source) == sources.names
    assert per_source["<lambda>_2"].tolist() == [1.0] * 5 and per_source["scaled"].tolist() == [3.0] * 5


def test_none_and_non_finite_become_nan(tok, llama):
    def sparse(prompts, completions, **kwargs):
        return [None, 0.5, math.inf, float("nan"), -math.inf]

    ids, decoded = rollout(tok, PROMPTS, COMPLETIONS)
    sources = RewardSources(policy_tokenizer=tok, reward_model=llama, reward_funcs=[true_reward, sparse])
    total, per_source = sources(query_response_ids=ids, prompts=PROMPTS, completions=decoded)
    assert per_source["sparse"].isnan().tolist() == [True, False, True, True, True]
    assert per_source["sparse"][1].item() == 0.5
    assert per_source["reward_model"].isfinite().all() and per_source["true_reward"].isfinite().all()
    # TRL's nansum: a source without a number for a row is left out of that row's sum
    others = per_source["reward_model"] + per_source["true_reward"]
    torch.testing.assert_close(total, others + torch.tensor([0.0, 0.5, 0.0, 0.0, 0.0]))
    zero_weight = RewardSources(
        policy_tokenizer=tok, reward_funcs=[true_reward, sparse], reward_weights=[1.0, 0.0]
    )(query_response_ids=ids, prompts=PROMPTS, completions=decoded)[0]
    torch.testing.assert_close(zero_weight, per_source["true_reward"])
    # a row that no source scored is NaN (the caller leaves it out of the update)
    alone = RewardSources(policy_tokenizer=tok, reward_funcs=[sparse, sparse], reward_weights=[1.0, 2.0])
    total = alone(query_response_ids=ids, prompts=PROMPTS, completions=decoded)[0]
    assert total.isnan().tolist() == [True, False, True, True, True] and total[1].item() == 1.5


@pytest.mark.parametrize(
    "result",
    [
        torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5]),
        torch.tensor([[0.1], [0.2], [0.3], [0.4], [0.5]], dtype=torch.float64),
        (0.1, 0.2, 0.3, 0.4, 0.5),
    ],
)
def test_tensors_and_tuples_are_accepted(tok, result):
    ids, decoded = rollout(tok, PROMPTS, COMPLETIONS)
    sources = RewardSources(policy_tokenizer=tok, reward_funcs=lambda prompts, completions, **kw: result)
    _, per_source = sources(query_response_ids=ids, prompts=PROMPTS, completions=decoded)
    torch.testing.assert_close(per_source["<lambda>"], torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5]))


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------


def test_construction_errors(kit, tok, alt, llama):
    with pytest.raises(ValueError, match=r"No reward source: got reward_model=None and no reward_funcs"):
        RewardSources(policy_tokenizer=tok)
    with pytest.raises(ValueError, match=r"No reward source"):
        RewardSources(policy_tokenizer=tok, reward_funcs=[])
    with pytest.raises(ValueError, match=r"reward_tokenizer was given without a reward_model"):
        RewardSources(policy_tokenizer=tok, reward_tokenizer=alt, reward_funcs=true_reward)
    with pytest.raises(
        ValueError, match=r"sequence-classification model with one label, got LlamaForCausalLM"
    ):
        RewardSources(policy_tokenizer=tok, reward_model=kit.load_model("llama"))
    config = AutoConfig.from_pretrained(kit.model_path("llama-seqcls"), num_labels=2)
    two_labels = AutoModelForSequenceClassification.from_config(config)
    with pytest.raises(ValueError, match=r"num_labels=2"):
        RewardSources(policy_tokenizer=tok, reward_model=two_labels)
    no_pad = kit.load_tokenizer("alt")
    no_pad.pad_token = None
    with pytest.raises(
        ValueError, match=r"reward_tokenizer has no pad token.*pad_token = reward_tokenizer.eos_token"
    ):
        RewardSources(
            policy_tokenizer=tok, reward_model=fresh(kit, "gpt2-alt-seqcls"), reward_tokenizer=no_pad
        )
    policy_no_pad = kit.load_tokenizer()
    policy_no_pad.pad_token = None
    with pytest.raises(ValueError, match=r"policy_tokenizer has no pad token"):
        RewardSources(policy_tokenizer=policy_no_pad, reward_model=llama)
    with pytest.raises(ValueError, match=r"batch_size must be an integer >= 1, got 0"):
        RewardSources(policy_tokenizer=tok, reward_funcs=true_reward, batch_size=0)
    with pytest.raises(ValueError, match=r"batch_size must be an integer >= 1, got True"):
        RewardSources(policy_tokenizer=tok, reward_funcs=true_reward, batch_size=True)
    with pytest.raises(ValueError, match=r"max_length must be None or an integer >= 1, got 0"):
        RewardSources(policy_tokenizer=tok, reward_funcs=true_reward, max_length=0)


def test_reward_function_signature_errors(tok):
    with pytest.raises(TypeError, match=r"reward_funcs\[1\] must be callable.*got str: 'accuracy'"):
        RewardSources(policy_tokenizer=tok, reward_funcs=[true_reward, "accuracy"])
    with pytest.raises(TypeError, match=r"reward_funcs must be a callable or a list of callables.*got str"):
        RewardSources(policy_tokenizer=tok, reward_funcs="accuracy")
    with pytest.raises(
        TypeError,
        match=r"'<lambda>' \(reward_funcs\[0\]\) has the signature \(p, c\).*keyword arguments only"
        r".*`lambda prompts, completions, \*\*kwargs: \.\.\.`",
    ):
        RewardSources(policy_tokenizer=tok, reward_funcs=lambda p, c: [0.0] * len(p))

    def positional_only(prompts, completions, /):
        return [0.0] * len(prompts)

    with pytest.raises(
        TypeError, match=r"'positional_only'.*`def positional_only\(prompts, completions, \*\*kwargs\)"
    ):
        RewardSources(policy_tokenizer=tok, reward_funcs=positional_only)

    def no_completions(prompts, text):
        return [0.0] * len(prompts)

    with pytest.raises(
        TypeError, match=r"'no_completions' \(reward_funcs\[0\]\) has the signature \(prompts, text\)"
    ):
        RewardSources(policy_tokenizer=tok, reward_funcs=no_completions)

    def star_args(*args):
        return []

    with pytest.raises(TypeError, match=r"'star_args'"):
        RewardSources(policy_tokenizer=tok, reward_funcs=[star_args])


def test_weight_errors(tok, llama):
    with pytest.raises(
        ValueError,
        match=r"reward_weights has 1 values but there are 2 reward sources \['reward_model', 'true_reward'\]",
    ):
        RewardSources(
            policy_tokenizer=tok, reward_model=llama, reward_funcs=true_reward, reward_weights=[1.0]
        )
    for bad in (math.nan, math.inf, "1.0", None):
        with pytest.raises(ValueError, match=r"finite floats; the weight of 'true_reward' is"):
            RewardSources(policy_tokenizer=tok, reward_funcs=true_reward, reward_weights=[bad])
    with pytest.raises(ValueError, match=r"reward_weights must be a list of 1 floats.*got float"):
        RewardSources(policy_tokenizer=tok, reward_funcs=true_reward, reward_weights=2.0)


def test_reward_function_result_errors(tok):
    ids, decoded = rollout(tok, PROMPTS, COMPLETIONS)

    def call(func):
        return RewardSources(policy_tokenizer=tok, reward_funcs=func)(
            query_response_ids=ids, prompts=PROMPTS, completions=decoded
        )

    def short(prompts, completions, **kwargs):
        return [1.0, 2.0, 3.0]

    with pytest.raises(ValueError, match=r"'short' returned 3 values for a batch of 5 completions"):
        call(short)

    def scalar(prompts, completions, **kwargs):
        return 1.0

    with pytest.raises(ValueError, match=r"'scalar' returned float, expected a list of 5 floats"):
        call(scalar)

    def text(prompts, completions, **kwargs):
        return ["1.0"] * 5

    with pytest.raises(TypeError, match=r"'text' returned '1.0' at index 0; expected a float or None"):
        call(text)

    def objects(prompts, completions, **kwargs):
        return [0.0, {"score": 1}, 0.0, 0.0, 0.0]

    with pytest.raises(TypeError, match=r"'objects' returned \{'score': 1\} \(dict\) at index 1"):
        call(objects)

    def broken(prompts, completions, **kwargs):
        raise KeyError("label")

    with pytest.raises(RuntimeError, match=r"reward function 'broken' raised KeyError: 'label'") as info:
        call(broken)
    assert isinstance(info.value.__cause__, KeyError)


def test_call_errors(tok, llama):
    ids, decoded = rollout(tok, PROMPTS, COMPLETIONS)
    sources = RewardSources(policy_tokenizer=tok, reward_model=llama, reward_funcs=true_reward)
    with pytest.raises(ValueError, match=r"got 5 prompts but 4 completions"):
        sources(query_response_ids=ids, prompts=PROMPTS, completions=decoded[:4])
    with pytest.raises(ValueError, match=r"query_response_ids has 4 rows but there are 5 prompts"):
        sources(query_response_ids=ids[:4], prompts=PROMPTS, completions=decoded)
    with pytest.raises(ValueError, match=r"must be a \(batch, length\) tensor, got Tensor of shape \(\d+,\)"):
        sources(query_response_ids=ids[0], prompts=PROMPTS, completions=decoded)
    with pytest.raises(ValueError, match=r"got list of shape None"):
        sources(query_response_ids=ids.tolist(), prompts=PROMPTS, completions=decoded)
    with pytest.raises(ValueError, match=r"column 'label' has 3 values for a batch of 5"):
        sources(query_response_ids=ids, prompts=PROMPTS, completions=decoded, columns={"label": [1, 2, 3]})
    with pytest.raises(
        ValueError, match=r"columns must not contain 'completions'.*Rename that dataset column"
    ):
        sources(
            query_response_ids=ids, prompts=PROMPTS, completions=decoded, columns={"completions": decoded}
        )


def test_position_ids_from_mask_matches_what_score_ids_assumes(tok):
    """Rows of a rollout: the first real token at position 0, counting through the response."""
    ids, _ = rollout(tok, PROMPTS[:2], COMPLETIONS[:2])
    mask = ids != tok.pad_token_id
    positions = F.position_ids_from_mask(mask)
    for row in range(2):
        real = mask[row].nonzero().flatten()
        assert positions[row, real].tolist() == list(range(len(real)))


# --------------------------------------------------------------------------------------------------
# The RewardSource protocol: sources of one's own, next to the built-in ones
# --------------------------------------------------------------------------------------------------


class LengthPenalty:
    """A reward source of one's own: minus the number of response tokens (read from the policy's ids)
    over ``scale``."""

    name = "length_penalty"

    def __init__(self, scale: float = 10.0) -> None:
        self.scale = scale
        self.batches: list[RewardBatch] = []

    def score(self, batch: RewardBatch) -> torch.Tensor:
        self.batches.append(batch)
        ids = batch.completion_ids
        return -(ids != batch.pad_token_id).sum(1).float() / self.scale


def test_built_in_sources_implement_the_protocol(tok, llama):
    sources = RewardSources(
        policy_tokenizer=tok, reward_model=llama, reward_funcs=[true_reward, LengthPenalty()]
    )
    assert all(isinstance(source, RewardSource) for source in sources.sources)
    model_source, function_source, own = sources.sources
    assert isinstance(model_source, RewardModelSource) and model_source is sources.model_source
    assert isinstance(function_source, RewardFunctionSource) and function_source.func is true_reward
    assert isinstance(own, LengthPenalty)
    assert sources.names == ["reward_model", "true_reward", "length_penalty"]
    assert [rlvr.reward_source("addition").name, rlvr.success_source("addition").name] == [
        "addition_reward",
        "success",
    ]
    assert isinstance(rlvr.reward_source("word_count"), RewardSource)


def test_a_source_of_ones_own_is_weighted_like_a_function(tok, llama):
    """A source gets the batch the functions see, with the policy's ids and the prompts' width, and counts
    in the total with its weight; alone it gives what the combiner reports for it."""
    ids, decoded = rollout(tok, PROMPTS, COMPLETIONS)
    width = ids.shape[1] - max(len(tok(c)["input_ids"]) + 1 for c in COMPLETIONS) - 2
    penalty = LengthPenalty()
    sources = RewardSources(
        policy_tokenizer=tok,
        reward_model=llama,
        reward_funcs=[true_reward, penalty],
        reward_weights=[1.0, 0.5, 2.0],
    )
    total, per_source = sources(
        query_response_ids=ids,
        prompts=PROMPTS,
        completions=decoded,
        columns={"topic": list("abcde")},
        prompt_width=width,
    )
    (batch,) = penalty.batches
    assert list(batch.prompts) == PROMPTS and list(batch.completions) == decoded and len(batch) == 5
    assert batch.columns == {"topic": list("abcde")} and batch.query_response_ids is ids
    lengths = torch.tensor([len(tok(c)["input_ids"]) + (c != UNFINISHED) for c in COMPLETIONS])
    torch.testing.assert_close(per_source["length_penalty"], -lengths.float() / 10)
    expected = (
        per_source["reward_model"] + 0.5 * per_source["true_reward"] + 2.0 * per_source["length_penalty"]
    )
    torch.testing.assert_close(total, expected)
    alone_total, _ = RewardSources(policy_tokenizer=tok, reward_funcs=LengthPenalty())(
        query_response_ids=ids, prompts=PROMPTS, completions=decoded, prompt_width=width
    )
    torch.testing.assert_close(alone_total, per_source["length_penalty"])


def test_a_source_is_checked_first_and_its_scores_must_fit(tok):
    ids, decoded = rollout(tok, PROMPTS, COMPLETIONS)
    order = []

    class Refuses:
        name = "refuses"

        def check(self, batch: RewardBatch) -> None:
            order.append("check")
            raise ValueError("refused before scoring")

        def score(self, batch: RewardBatch) -> torch.Tensor:
            raise AssertionError("scored after its check refused the batch")

    def first(prompts, completions, **kwargs):
        order.append("first")
        return [0.0] * len(prompts)

    with pytest.raises(ValueError, match="refused before scoring"):
        RewardSources(policy_tokenizer=tok, reward_funcs=[first, Refuses()])(
            query_response_ids=ids, prompts=PROMPTS, completions=decoded
        )
    assert order == ["check"]

    class TooFew:
        name = "too_few"

        def score(self, batch: RewardBatch) -> list[float]:
            return [1.0] * (len(batch) - 1)

    with pytest.raises(
        ValueError, match=r"reward source 'too_few' returned scores of shape \(4,\) for a batch of 5"
    ):
        RewardSources(policy_tokenizer=tok, reward_funcs=TooFew())(
            query_response_ids=ids, prompts=PROMPTS, completions=decoded
        )
    with pytest.raises(ValueError, match="carries no completion ids"):
        RewardSources(policy_tokenizer=tok, reward_funcs=LengthPenalty())(
            query_response_ids=ids, prompts=PROMPTS, completions=decoded
        )


def test_a_failing_source_counts_its_rows(tok):
    """``last_errors`` of every source is summed (a function skipped under ``on_error='skip'``, or a
    source of one's own that reports rows it could not score)."""
    ids, decoded = rollout(tok, PROMPTS, COMPLETIONS)

    class Partial:
        name = "partial"
        last_errors = 0

        def score(self, batch: RewardBatch) -> torch.Tensor:
            self.last_errors = 2
            return torch.tensor([1.0, 1.0, 1.0, math.nan, math.nan])

    def broken(prompts, completions, **kwargs):
        raise RuntimeError("down")

    sources = RewardSources(policy_tokenizer=tok, reward_funcs=[broken, Partial()], on_error="skip")
    total, per_source = sources(query_response_ids=ids, prompts=PROMPTS, completions=decoded)
    assert sources.last_errors == 5 + 2
    assert per_source["broken"].isnan().all() and total.isnan().all()
    assert per_source["partial"][:3].tolist() == [1.0] * 3


def test_a_source_of_ones_own_plugs_into_a_trainer(kit, tmp_path):
    """A class implementing the protocol goes into GRPO's ``reward_funcs`` beside a function, with no engine
    change: it scores every rollout batch and its metric ``objective/scores/<name>`` is logged."""
    from rlhf_trainers import GRPOConfig, GRPOTrainer

    penalty = LengthPenalty()
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-3,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        num_sample_generations=0,
        disable_tqdm=True,
        reward_weights=[1.0, 0.5],
    )
    trainer = GRPOTrainer(
        model=kit.load_model("llama-sft"),
        reward_funcs=[true_reward, penalty],
        args=args,
        train_dataset=kit.prompt_dataset("train", n=32),
        processing_class=kit.load_tokenizer(),
    )
    assert trainer.reward_sources.names == ["true_reward", "length_penalty"]
    trainer.train()
    assert len(penalty.batches) == 2
    batch = penalty.batches[0]
    assert len(batch) == 8 and batch.completion_ids.shape == (8, 8)
    logged = [entry for entry in trainer.state.log_history if "objective/scores/length_penalty" in entry]
    assert len(logged) == 2
    for entry in logged:
        assert -0.8 <= entry["objective/scores/length_penalty"] < 0  # 1 to 8 tokens, over 10
        assert "objective/scores/true_reward" in entry


# --------------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU)
# --------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reward_model_on_cuda_takes_cpu_ids_and_returns_cpu_float32(kit, tok, alt, llama, gpt2_alt):
    ids, decoded = rollout(tok, PROMPTS, COMPLETIONS)
    for model, reward_tokenizer in ((llama, None), (gpt2_alt, alt)):
        cpu = RewardSources(policy_tokenizer=tok, reward_model=model, reward_tokenizer=reward_tokenizer)
        expected = cpu(query_response_ids=ids, prompts=PROMPTS, completions=decoded)[0]
        on_gpu = copy.deepcopy(model).cuda()
        sources = RewardSources(
            policy_tokenizer=tok,
            reward_model=on_gpu,
            reward_tokenizer=reward_tokenizer,
            reward_funcs=true_reward,
        )
        for query in (ids, ids.cuda()):
            total, per_source = sources(query_response_ids=query, prompts=PROMPTS, completions=decoded)
            for value in (total, *per_source.values()):
                assert value.device.type == "cpu" and value.dtype == torch.float32
            torch.testing.assert_close(per_source["reward_model"], expected, rtol=0, atol=1e-4)
    bf16 = kit.load_model("llama-seqcls", dtype=torch.bfloat16).cuda()
    sources = RewardSources(policy_tokenizer=tok, reward_model=bf16)
    _, per_source = sources(query_response_ids=ids, prompts=PROMPTS, completions=decoded)
    assert per_source["reward_model"].dtype == torch.float32
    torch.testing.assert_close(
        per_source["reward_model"],
        RewardSources(policy_tokenizer=tok, reward_model=llama)(
            query_response_ids=ids, prompts=PROMPTS, completions=decoded
        )[0],
        rtol=0,
        atol=0.05,
    )
