"""Preference data: format detection, tokenization (EOS, truncation, margins) and the pair collator."""

from __future__ import annotations

import copy

import datasets
import pytest
import torch

from rlhf_trainers.data import (
    PREFERENCE_FORMATS,
    PreferenceCollator,
    PreferenceTokenizationStats,
    detect_preference_format,
    tokenize_preferences,
)


@pytest.fixture(scope="module")
def tokenizer(kit):
    return kit.load_tokenizer()


def tokenized_dataset(chosen, rejected, **extra):
    return datasets.Dataset.from_dict({"input_ids_chosen": chosen, "input_ids_rejected": rejected, **extra})


# --------------------------------------------------------------------------------------------------
# Format detection
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "expected"), [("explicit", "explicit"), ("implicit", "implicit"), ("chat", "conversational")]
)
def test_detects_kit_formats(kit, shape, expected):
    assert detect_preference_format(kit.preference_dataset("test", n=4, shape=shape)) == expected


def test_detects_tokenized_and_prefers_it_over_text_columns():
    ds = tokenized_dataset([[5, 6, 7]], [[8, 9]])
    assert detect_preference_format(ds) == "tokenized"
    with_text = ds.add_column("chosen", ["a"]).add_column("rejected", ["b"])
    assert detect_preference_format(with_text) == "tokenized"


def test_conversational_without_prompt_column(kit):
    chat = kit.preference_dataset("test", n=2, shape="chat")
    implicit_chat = chat.map(
        lambda row: {"chosen": row["prompt"] + row["chosen"], "rejected": row["prompt"] + row["rejected"]},
        remove_columns=["prompt"],
    )
    assert detect_preference_format(implicit_chat) == "conversational"


def test_preference_formats_table():
    assert PREFERENCE_FORMATS["explicit"] == ("prompt", "chosen", "rejected")
    assert PREFERENCE_FORMATS["tokenized"] == ("input_ids_chosen", "input_ids_rejected")
    assert set(PREFERENCE_FORMATS) == {"explicit", "implicit", "conversational", "tokenized"}


def test_error_empty_dataset(kit):
    with pytest.raises(ValueError, match="has 0 rows"):
        detect_preference_format(kit.preference_dataset("test", n=0))


def test_error_missing_columns_names_them_and_lists_formats():
    ds = datasets.Dataset.from_dict({"prompt": ["p"], "chosen": ["c"]})
    with pytest.raises(ValueError, match="missing 'rejected'") as info:
        detect_preference_format(ds)
    message = str(info.value)
    for name, columns in PREFERENCE_FORMATS.items():
        assert f"{name}: {', '.join(columns)}" in message
    assert "margin" in message
    with pytest.raises(ValueError, match="'input_ids_rejected' for tokenized"):
        detect_preference_format(datasets.Dataset.from_dict({"input_ids_chosen": [[1]]}))


@pytest.mark.parametrize(
    ("columns", "pattern"),
    [
        ({"chosen": [3], "rejected": [4]}, r"column 'chosen': the first row holds int \(3\).*string"),
        ({"prompt": [1], "chosen": ["a"], "rejected": ["b"]}, r"column 'prompt'.*int.*a string"),
        ({"chosen": ["a"], "rejected": [[1, 2]]}, r"column 'rejected'.*list of int"),
        (
            {"chosen": [[{"role": "user", "content": "hi"}]], "rejected": ["text"]},
            r"column 'rejected'.*str.*messages",
        ),
        (
            {
                "prompt": ["p"],
                "chosen": [[{"role": "user", "content": "hi"}]],
                "rejected": [[{"role": "u", "content": "x"}]],
            },
            r"column 'prompt'.*str.*messages",
        ),
        (
            {"input_ids_chosen": [["a"]], "input_ids_rejected": [[1]]},
            r"'input_ids_chosen'.*list of str.*token ids",
        ),
        ({"chosen": ["a"], "rejected": ["b"], "margin": ["big"]}, r"column 'margin'.*str.*a float"),
    ],
)
def test_error_wrong_types(columns, pattern):
    with pytest.raises(ValueError, match=pattern):
        detect_preference_format(datasets.Dataset.from_dict(columns))


def test_error_dataset_dict(kit):
    dd = datasets.DatasetDict({"train": kit.preference_dataset("train", n=2)})
    with pytest.raises(TypeError, match=r"pick one, e\.g\. dataset\[\"train\"\]"):
        detect_preference_format(dd)
    with pytest.raises(TypeError, match=r"expected a datasets\.Dataset, got list"):
        detect_preference_format([{"chosen": "a", "rejected": "b"}])


# --------------------------------------------------------------------------------------------------
# Tokenization
# --------------------------------------------------------------------------------------------------


def test_explicit_and_implicit_tokenize_identically_in_order(kit, tokenizer):
    explicit = kit.preference_dataset("train", shape="explicit")
    out_e, stats = tokenize_preferences(explicit, tokenizer)
    out_i, _ = tokenize_preferences(kit.preference_dataset("train", shape="implicit"), tokenizer)
    assert out_e.column_names == ["input_ids_chosen", "input_ids_rejected", "margin"]
    assert list(out_e["input_ids_chosen"]) == list(out_i["input_ids_chosen"])
    assert list(out_e["input_ids_rejected"]) == list(out_i["input_ids_rejected"])
    assert stats == PreferenceTokenizationStats(
        num_rows=2048, num_kept=2048, num_truncated=0, num_dropped=0, max_length=512
    )
    # Row order: row i holds pair i (spot-check against tokenizing the rows one by one).
    eos = tokenizer.eos_token_id
    for i in (0, 1, 777, 2047):
        row = explicit[i]
        assert out_e[i]["input_ids_chosen"] == tokenizer(row["prompt"] + row["chosen"])["input_ids"] + [eos]
        assert out_e[i]["input_ids_rejected"] == tokenizer(row["prompt"] + row["rejected"])["input_ids"] + [
            eos
        ]


def test_row_order_preserved_with_num_proc(kit, tokenizer):
    ds = kit.preference_dataset("test", n=64)
    single, _ = tokenize_preferences(ds, tokenizer)
    multi, stats = tokenize_preferences(ds, tokenizer, num_proc=2)
    assert stats.num_kept == 64
    assert list(multi["input_ids_chosen"]) == list(single["input_ids_chosen"])


def test_conversational_goes_through_chat_template(kit, tokenizer):
    chat = kit.preference_dataset("test", n=8, shape="chat")
    out, _ = tokenize_preferences(chat, tokenizer)
    row = chat[3]
    text = tokenizer.decode(out[3]["input_ids_chosen"])
    expected = (
        f"<|user|>{row['prompt'][0]['content']}\n<|assistant|>{row['chosen'][0]['content']}\n<|endoftext|>"
    )
    assert text == expected
    assert "<|assistant|>" + row["rejected"][0]["content"] in tokenizer.decode(out[3]["input_ids_rejected"])
    # Without a prompt column (the prompt inside chosen/rejected), the ids are the same.
    merged = chat.map(
        lambda r: {"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]},
        remove_columns=["prompt"],
    )
    out_merged, _ = tokenize_preferences(merged, tokenizer)
    assert list(out_merged["input_ids_chosen"]) == list(out["input_ids_chosen"])


def test_eos_appended_exactly_once(tokenizer):
    eos, eos_token = tokenizer.eos_token_id, tokenizer.eos_token
    ds = datasets.Dataset.from_dict(
        {
            "prompt": ["the movie was", "the room is"],
            "chosen": [" good .", " warm ." + eos_token],
            "rejected": [" bad .", " cold ."],
        }
    )
    out, _ = tokenize_preferences(ds, tokenizer)
    for ids in (*out["input_ids_chosen"], *out["input_ids_rejected"]):
        assert ids[-1] == eos and ids.count(eos) == 1
    no_eos, _ = tokenize_preferences(ds, tokenizer, add_eos=False)
    assert no_eos[0]["input_ids_chosen"] == out[0]["input_ids_chosen"][:-1]
    assert no_eos[1]["input_ids_chosen"] == out[1]["input_ids_chosen"]  # its text already ends with EOS


def test_tokenized_format_ids_used_as_given(tokenizer):
    ds = tokenized_dataset([[5, 6, 7], [8]], [[9, 10], [11, 12, 13]], extra=["x", "y"])
    out, stats = tokenize_preferences(ds, tokenizer)
    assert out.column_names == ["input_ids_chosen", "input_ids_rejected", "margin"]
    assert out.to_dict() == {
        "input_ids_chosen": [[5, 6, 7], [8]],
        "input_ids_rejected": [[9, 10], [11, 12, 13]],
        "margin": [0.0, 0.0],
    }
    assert stats.num_kept == 2


def test_margin_carried_and_defaults_to_zero(kit, tokenizer):
    ds = kit.preference_dataset("test", n=3)
    out, _ = tokenize_preferences(ds, tokenizer)
    assert list(out["margin"]) == [0.0, 0.0, 0.0]
    with_margin, _ = tokenize_preferences(ds.add_column("margin", [0.5, 2, -1.25]), tokenizer)
    assert list(with_margin["margin"]) == [0.5, 2.0, -1.25]


def test_truncation_keeps_response_end_and_counts(kit, tokenizer):
    ds = kit.preference_dataset("test", n=64)
    full, _ = tokenize_preferences(ds, tokenizer, max_length=None)
    out, stats = tokenize_preferences(ds, tokenizer, max_length=8)
    num_long = 0
    for f, o in zip(full, out, strict=True):
        long = max(len(f["input_ids_chosen"]), len(f["input_ids_rejected"])) > 8
        num_long += long
        for side in ("input_ids_chosen", "input_ids_rejected"):
            assert o[side] == f[side][-8:]  # the last 8 tokens: response end and EOS
            assert o[side][-1] == tokenizer.eos_token_id
    assert 0 < num_long < 64
    assert stats == PreferenceTokenizationStats(
        num_rows=64, num_kept=64, num_truncated=num_long, num_dropped=0, max_length=8
    )


def test_truncation_keeps_leading_bos(tokenizer):
    bos = tokenizer.bos_token_id
    ds = tokenized_dataset([[bos, 10, 11, 12, 13, 14]], [[20, 21, 22, 23]])
    out, stats = tokenize_preferences(ds, tokenizer, max_length=3)
    assert out[0]["input_ids_chosen"] == [bos, 13, 14]
    assert out[0]["input_ids_rejected"] == [21, 22, 23]
    assert stats.num_truncated == 1


def test_drop_removes_long_pairs_and_counts(tokenizer):
    ds = tokenized_dataset(
        [[1, 2], [3, 4, 5, 6], [7], [8, 9, 10]],
        [[11], [12], [13, 14, 15, 16, 17], [18, 19]],
        margin=[0.0, 1.0, 2.0, 3.0],
    )
    out, stats = tokenize_preferences(ds, tokenizer, max_length=3, long_pairs="drop")
    assert out.to_dict() == {
        "input_ids_chosen": [[1, 2], [8, 9, 10]],
        "input_ids_rejected": [[11], [18, 19]],
        "margin": [0.0, 3.0],
    }
    assert stats == PreferenceTokenizationStats(
        num_rows=4, num_kept=2, num_truncated=0, num_dropped=2, max_length=3
    )
    everything, stats_all = tokenize_preferences(ds, tokenizer, max_length=1000, long_pairs="drop")
    assert len(everything) == 4 and stats_all.num_dropped == 0
    shortest, stats_2 = tokenize_preferences(ds, tokenizer, max_length=2, long_pairs="drop")
    assert list(shortest["margin"]) == [0.0] and stats_2.num_dropped == 3


def test_drop_everything_leaves_an_empty_dataset_with_the_columns(tokenizer):
    ds = tokenized_dataset([[1, 2, 3]], [[4, 5, 6]])
    empty, stats = tokenize_preferences(ds, tokenizer, max_length=2, long_pairs="drop")
    assert len(empty) == 0 and stats.num_dropped == 1 and stats.num_kept == 0
    assert empty.column_names == ["input_ids_chosen", "input_ids_rejected", "margin"]


def test_error_no_pad_token(kit, tokenizer):
    no_pad = copy.deepcopy(tokenizer)
    no_pad.pad_token = None
    with pytest.raises(ValueError, match=r"no pad token.*add_special_tokens\(\{'pad_token'"):
        tokenize_preferences(kit.preference_dataset("test", n=2), no_pad)


def test_error_no_chat_template(kit, tokenizer):
    no_template = copy.deepcopy(tokenizer)
    no_template.chat_template = None
    with pytest.raises(ValueError, match=r"no chat template.*tokenizer\.chat_template.*text columns"):
        tokenize_preferences(kit.preference_dataset("test", n=2, shape="chat"), no_template)
    # Text formats do not need one.
    out, _ = tokenize_preferences(kit.preference_dataset("test", n=2), no_template)
    assert len(out) == 2


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"long_pairs": "cut"}, r"long_pairs='cut': must be 'truncate'.*or 'drop'"),
        ({"max_length": 1}, r"max_length=1: must be an integer >= 2"),
        ({"max_length": 8.5}, r"max_length=8.5"),
        ({"num_proc": 0}, r"num_proc=0"),
    ],
)
def test_error_bad_arguments(kit, tokenizer, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        tokenize_preferences(kit.preference_dataset("test", n=2), tokenizer, **kwargs)


def test_error_missing_value_names_row(tokenizer):
    ds = datasets.Dataset.from_dict({"prompt": ["a", "b"], "chosen": [" x", None], "rejected": [" y", " z"]})
    with pytest.raises(ValueError, match=r"row 1: column 'chosen'.*expected a string"):
        tokenize_preferences(ds, tokenizer)


def test_error_empty_sequence(tokenizer):
    ds = datasets.Dataset.from_dict({"chosen": ["good", ""], "rejected": ["bad", "x"]})
    with pytest.raises(ValueError, match=r"row 1: chosen has 0 tokens"):
        tokenize_preferences(ds, tokenizer, add_eos=False)


# --------------------------------------------------------------------------------------------------
# Collator
# --------------------------------------------------------------------------------------------------

ROWS = [
    {"input_ids_chosen": [5, 6, 7], "input_ids_rejected": [8], "margin": 1.5},
    {"input_ids_chosen": [9], "input_ids_rejected": [10, 11, 12, 13], "margin": -0.5},
]


def test_collator_right_padding_layout():
    batch = PreferenceCollator(pad_token_id=1)(ROWS)
    assert set(batch) == {"input_ids", "attention_mask", "margin"}
    assert batch["input_ids"].tolist() == [
        [5, 6, 7, 1],  # chosen of pair 0
        [9, 1, 1, 1],  # chosen of pair 1
        [8, 1, 1, 1],  # rejected of pair 0
        [10, 11, 12, 13],  # rejected of pair 1
    ]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert batch["input_ids"].dtype == torch.long and batch["attention_mask"].dtype == torch.long
    assert batch["margin"].dtype == torch.float32
    assert batch["margin"].tolist() == [1.5, -0.5]


def test_collator_left_padding_and_multiple_of():
    batch = PreferenceCollator(pad_token_id=0, padding_side="left", pad_to_multiple_of=3)(ROWS)
    assert batch["input_ids"].tolist() == [
        [0, 0, 0, 5, 6, 7],
        [0, 0, 0, 0, 0, 9],
        [0, 0, 0, 0, 0, 8],
        [0, 0, 10, 11, 12, 13],
    ]
    assert batch["attention_mask"].tolist() == (batch["input_ids"] != 0).long().tolist()


def test_collator_defaults_margin_and_accepts_tensors():
    rows = [{"input_ids_chosen": torch.tensor([3, 4]), "input_ids_rejected": torch.tensor([5])}]
    batch = PreferenceCollator(pad_token_id=1, pad_to_multiple_of=8)(rows)
    assert batch["input_ids"].shape == (2, 8)
    assert batch["margin"].tolist() == [0.0]


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"pad_token_id": None}, r"pad_token_id=None.*add_special_tokens"),
        ({"pad_token_id": 1, "padding_side": "middle"}, r"padding_side='middle'"),
        ({"pad_token_id": 1, "pad_to_multiple_of": 0}, r"pad_to_multiple_of=0"),
    ],
)
def test_collator_errors(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        PreferenceCollator(**kwargs)
    with pytest.raises(ValueError, match="empty list"):
        PreferenceCollator(pad_token_id=1)([])


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_collated_batch_scores_like_unpadded_sequences(kit, tokenizer, padding_side):
    """The reward model reads the same score from the padded batch as from each sequence alone."""
    model = kit.load_model("llama-seqcls")
    assert model.config.pad_token_id == tokenizer.pad_token_id
    out, _ = tokenize_preferences(kit.preference_dataset("test", n=4), tokenizer)
    rows = list(out)
    batch = PreferenceCollator(tokenizer.pad_token_id, padding_side=padding_side)(rows)
    with torch.no_grad():
        batched = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
        alone = [
            model(input_ids=torch.tensor([row[side]])).logits[0, 0]
            for side in ("input_ids_chosen", "input_ids_rejected")
            for row in rows
        ]
    torch.testing.assert_close(batched, torch.stack(alone), atol=1e-5, rtol=1e-4)
