"""Fuzzing the data path (issue #8): odd prompts and pairs give a valid tokenization or a clear error.

Hypothesis draws texts with what real datasets hold by accident: empty strings, whitespace and control
characters, NUL, right-to-left scripts, combining marks, emoji sequences with joiners and modifiers, a
byte-order mark, literal special tokens, and lines of thousands of characters; chat prompts with
unexpected roles, missing roles or content, and content given as parts; token ids out of range. Each
goes through :func:`rlhf_trainers.data.detect_prompt_format`, :func:`~rlhf_trainers.data.tokenize_prompts`,
:class:`~rlhf_trainers.data.PromptCollator`, and the trainers' own preparation (construction of
RLOOTrainer and RewardTrainer). The property is the same everywhere: either the result is exactly what
the tokenizer makes of the input (ids in the vocabulary, truncated as asked, padded on the left), or a
ValueError that names the row and says what is wrong; never another exception.

The kit's tokenizer is byte-level: every non-empty string has at least one token, so an empty string
is the only text prompt that must fail. Examples per test are bounded (the file runs in well under 30 s).
"""

from __future__ import annotations

import re
from typing import Any

import datasets
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rlhf_trainers import RewardConfig, RewardTrainer, RLOOConfig, RLOOTrainer
from rlhf_trainers.data import PromptCollator, detect_prompt_format, tokenize_preferences, tokenize_prompts
from rlhf_trainers.testing import true_reward

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Pieces that break naive text handling; st.text() adds arbitrary code points on top.
ODD_PIECES = [
    "",
    " ",
    "\n",
    "\r\n\t",
    "\x00",
    "\ufeff",  # byte-order mark
    "\u200f",  # right-to-left mark
    "שלום עולם",
    "مرحبا بالعالم",
    "e\u0301\u0301",  # combining acute accents
    "Z\u0351\u0352\u0353",
    "🤖👍🏽",
    "\U0001f469\u200d\U0001f4bb",  # ZWJ sequence
    "🇫🇷",
    "<|pad|>",
    "<|endoftext|>",
    "<|user|>",
    "the movie was good .",
]
odd_text = st.one_of(
    st.text(max_size=30),
    st.lists(st.sampled_from(ODD_PIECES), max_size=6).map("".join),
    st.builds(
        lambda piece, n: piece * n, st.sampled_from(["good ", "x", "🤖", "\u0301"]), st.integers(100, 1500)
    ),
)
nonempty_text = odd_text.filter(bool)
ROLES = ["user", "system", "assistant", "tool", "", "USER", "🤖", "a" * 40, None]

# What a clear error says: our messages, each naming the row or the dataset (the "first row" for the
# format, decided on row 0).
CLEAR = re.compile(r"row \d+|first row|dataset has 0 rows|train dataset|the longest prompt")


# TrainingArguments of a construction-only trainer: CPU, quiet, one step.
QUIET = {"use_cpu": True, "report_to": "none", "disable_tqdm": True, "max_steps": 1}


def _pairs(triples: list[tuple[str, str, str]]) -> datasets.Dataset:
    return datasets.Dataset.from_dict(
        {name: [t[i] for t in triples] for i, name in enumerate(("prompt", "chosen", "rejected"))}
    )


@pytest.fixture(scope="module")
def tok(kit):
    return kit.load_tokenizer()


def _cut(ids: list[int], n: int | None, bos: int | None) -> list[int]:
    """The documented truncation: the last `n` ids, a leading BOS kept in front of the last n - 1."""
    if n is None or len(ids) <= n:
        return ids
    if bos is not None and ids[0] == bos:
        return [bos, *ids[len(ids) - n + 1 :]]
    return ids[-n:]


def _check_clear(err: Exception) -> str:
    assert isinstance(err, ValueError), f"{type(err).__name__}: {err}"
    message = str(err)
    assert CLEAR.search(message), message
    return message


# --------------------------------------------------------------------------------------------------
# text prompts
# --------------------------------------------------------------------------------------------------


@FUZZ
@given(st.lists(odd_text, min_size=1, max_size=6), st.one_of(st.none(), st.integers(1, 24)))
def test_text_prompts_tokenize_as_the_tokenizer_does_or_name_the_empty_row(tok, texts, max_len):
    ds = datasets.Dataset.from_dict({"prompt": texts, "extra": list(range(len(texts)))})
    assert detect_prompt_format(ds) == "text"
    empty = [i for i, t in enumerate(texts) if t == ""]
    try:
        out, stats = tokenize_prompts(ds, tok, max_prompt_length=max_len, vocab_size=len(tok))
    except Exception as err:
        message = _check_clear(err)
        assert empty and f"row {empty[0]}: the prompt has 0 tokens" in message, message
        return
    assert not empty
    full = [tok(t)["input_ids"] for t in texts]
    assert list(out["extra"]) == list(range(len(texts))) and list(out["prompt"]) == texts
    for ids, expected in zip(out["input_ids"], full, strict=True):
        assert ids == _cut(expected, max_len, tok.bos_token_id)
        assert all(0 <= i < len(tok) for i in ids) and len(ids) >= 1
    assert stats.longest == max(len(f) for f in full)
    assert stats.num_truncated == (0 if max_len is None else sum(len(f) > max_len for f in full))


@FUZZ
@given(st.lists(st.lists(st.integers(0, 626), min_size=1, max_size=40), min_size=1, max_size=8), st.data())
def test_collator_left_pads_any_rows_and_passes_columns_through(ids, data):
    extra = data.draw(st.lists(odd_text, min_size=len(ids), max_size=len(ids)))
    multiple = data.draw(st.one_of(st.none(), st.integers(1, 16)))
    rows = [{"input_ids": x, "text": t} for x, t in zip(ids, extra, strict=True)]
    batch = PromptCollator(pad_token_id=1, pad_to_multiple_of=multiple)(rows)
    T = batch["input_ids"].shape[1]
    assert T >= max(len(x) for x in ids) and (multiple is None or T % multiple == 0)
    assert batch["text"] == extra
    for row, x in enumerate(ids):
        n = len(x)
        assert batch["input_ids"][row, T - n :].tolist() == x
        assert (batch["input_ids"][row, : T - n] == 1).all()
        assert batch["attention_mask"][row].tolist() == [0] * (T - n) + [1] * n


@FUZZ
@given(st.lists(st.lists(st.integers(-3, 700), max_size=6), min_size=1, max_size=6))
def test_token_id_prompts_are_kept_or_the_bad_row_is_named(tok, ids):
    ds = datasets.Dataset.from_dict(
        {"input_ids": ids}, features=datasets.Features({"input_ids": datasets.List(datasets.Value("int64"))})
    )
    bad = [i for i, x in enumerate(ids) if not x or any(not 0 <= t < len(tok) for t in x)]
    try:
        out, _ = tokenize_prompts(ds, tok, vocab_size=len(tok))
    except Exception as err:
        message = _check_clear(err)
        assert bad and f"row {bad[0]}:" in message, message
        return
    assert not bad and [list(x) for x in out["input_ids"]] == ids


# --------------------------------------------------------------------------------------------------
# chat prompts
# --------------------------------------------------------------------------------------------------


@st.composite
def chat_message(draw, parts: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if draw(st.integers(0, 9)):  # one message in ten has no role key at all
        out["role"] = draw(st.sampled_from(ROLES))
    if draw(st.integers(0, 9)):
        if parts:
            out["content"] = draw(
                st.one_of(
                    st.none(),
                    st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": odd_text}), max_size=3),
                )
            )
        else:
            out["content"] = draw(st.one_of(st.none(), odd_text))
    return out


def _first_bad_conversation(conversations: list[list[dict[str, Any]]]) -> int | None:
    """The first row our rules reject: no messages, a message without a role or content, or an
    assistant turn at the end."""
    for i, conv in enumerate(conversations):
        if not conv:
            return i
        for m in conv:
            if not isinstance(m.get("role"), str) or not m.get("role"):
                return i
            if not isinstance(m.get("content"), (str, list)):
                return i
        if conv[-1]["role"] == "assistant":
            return i
    return None


@FUZZ
@given(st.booleans(), st.data())
def test_chat_prompts_go_through_the_template_or_name_the_bad_row(tok, parts, data):
    conversations = data.draw(st.lists(st.lists(chat_message(parts), max_size=4), min_size=1, max_size=4))
    try:
        ds = datasets.Dataset.from_list([{"prompt": c} for c in conversations])
    except Exception:
        assume(False)
    # What the rows look like after Arrow (missing keys read as None), which is what the tokenizer sees.
    stored = [list(c) for c in ds["prompt"]]
    bad = _first_bad_conversation(stored)
    try:
        out, stats = tokenize_prompts(ds, tok)
    except Exception as err:
        message = _check_clear(err)
        assert bad is not None, message
        # row 0 decides the format: an empty first conversation (or no message with a content key at all)
        # is reported as "the first row holds ..."
        assert f"row {bad}:" in message or (bad == 0 and "first row" in message), message
        return
    assert bad is None, stored[bad]
    assert stats.format == "conversational"
    for ids, conv in zip(out["input_ids"], stored, strict=True):
        text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        assert ids == tok(text, add_special_tokens=False)["input_ids"]


def test_a_chat_template_that_rejects_a_role_is_reported_with_the_row(kit):
    tok = kit.load_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] not in ['user', 'system'] %}"
        "{{ raise_exception('unknown role ' ~ m['role']) }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    ds = datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": "hi"}]}, {"prompt": [{"role": "tool", "content": "x"}]}]
    )
    with pytest.raises(
        ValueError, match=r"row 1: the tokenizer's chat template fails .*unknown role tool.*\['tool'\]"
    ):
        tokenize_prompts(ds, tok)


# --------------------------------------------------------------------------------------------------
# preference pairs
# --------------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(odd_text, odd_text, odd_text), min_size=1, max_size=5), st.sampled_from([None, 2, 16])
)
def test_odd_preference_pairs_tokenize_with_eos_and_truncation(tok, triples, max_length):
    ds = _pairs(triples)
    out, stats = tokenize_preferences(ds, tok, max_length=max_length, vocab_size=len(tok))
    eos = tok.eos_token_id
    assert stats.num_kept == len(triples)
    for row, (prompt, chosen, rejected) in zip(out, triples, strict=True):
        for side, text in (("input_ids_chosen", chosen), ("input_ids_rejected", rejected)):
            full = tok(prompt + text)["input_ids"]
            full = full if full and full[-1] == eos else [*full, eos]
            assert row[side] == _cut(full, max_length, tok.bos_token_id)
            assert all(0 <= i < len(tok) for i in row[side])


# --------------------------------------------------------------------------------------------------
# the trainers' own preparation
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(kit):
    return {"policy": kit.load_model("llama-sft"), "reward": kit.load_model("llama-seqcls")}


@FEW
@given(st.lists(nonempty_text, min_size=4, max_size=4), st.sampled_from([None, 32]))
def test_rloo_trainer_prepares_odd_prompts_or_fails_clearly(
    kit, tok, models, tmp_path_factory, texts, max_len
):
    args = RLOOConfig(
        output_dir=str(tmp_path_factory.mktemp("rloo")),
        per_device_train_batch_size=4,
        rloo_k=2,
        response_length=16,
        max_prompt_length=max_len,
        num_sample_generations=0,
        **QUIET,
    )
    try:
        trainer = RLOOTrainer(
            model=models["policy"],
            processing_class=tok,
            reward_funcs=true_reward,
            args=args,
            train_dataset=datasets.Dataset.from_dict({"prompt": texts}),
        )
    except Exception as err:
        message = _check_clear(err)
        known = ("holds the pad token", "response_length (16)")
        assert any(k in message for k in known), message
        return
    lengths = [len(x) for x in trainer.train_dataset["input_ids"]]
    assert min(lengths) >= 1 and max(lengths) + 16 <= 256
    assert max_len is None or max(lengths) <= max_len
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    assert batch["input_ids"].shape == (4, max(lengths)) and batch["prompt"] == texts
    assert int(batch["input_ids"].max()) < len(tok)


@FEW
@given(st.lists(st.tuples(odd_text, odd_text, odd_text), min_size=2, max_size=2))
def test_reward_trainer_prepares_odd_pairs(kit, tok, models, tmp_path_factory, triples):
    args = RewardConfig(
        output_dir=str(tmp_path_factory.mktemp("reward")),
        max_length=48,
        per_device_train_batch_size=2,
        **QUIET,
    )
    ds = _pairs(triples)
    trainer = RewardTrainer(models["reward"], args, train_dataset=ds, processing_class=tok)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    assert batch["input_ids"].shape[0] == 4 and batch["input_ids"].shape[1] <= 48
    assert int(batch["input_ids"].max()) < len(tok)
    with torch.no_grad():
        rewards = models["reward"](
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits
    assert torch.isfinite(rewards).all()
