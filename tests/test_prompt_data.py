"""Prompt data for PPO/RLOO: format detection, tokenization (chat template, left truncation) and the collator."""

from __future__ import annotations

import copy

import datasets
import pytest
import torch
from tokenizers import processors

from rlhf_trainers.data import (
    PROMPT_FORMATS,
    PromptCollator,
    PromptTokenizationStats,
    detect_prompt_format,
    tokenize_prompts,
)


@pytest.fixture(scope="module")
def tokenizer(kit):
    return kit.load_tokenizer()


@pytest.fixture(scope="module")
def bos_tokenizer(tokenizer):
    """The kit tokenizer, but adding BOS in front of every text (the kit's own adds no special tokens)."""
    tok = copy.deepcopy(tokenizer)
    bos = tok.bos_token
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tok.bos_token_id)]
    )
    assert tok("the movie was")["input_ids"][0] == tok.bos_token_id
    return tok


def ids_dataset(input_ids, **extra):
    return datasets.Dataset.from_dict({"input_ids": input_ids, **extra})


def user(text):
    return [{"role": "user", "content": text}]


# --------------------------------------------------------------------------------------------------
# Format detection
# --------------------------------------------------------------------------------------------------


def test_prompt_formats():
    assert PROMPT_FORMATS == ("text", "conversational", "tokenized")


def test_detects_each_format(kit):
    assert detect_prompt_format(kit.prompt_dataset("test", n=3)) == "text"
    assert detect_prompt_format(kit.prompt_dataset("test", n=3, chat=True)) == "conversational"
    messages = kit.prompt_dataset("test", n=3, chat=True).rename_column("prompt", "messages")
    assert detect_prompt_format(messages) == "conversational"
    assert detect_prompt_format(ids_dataset([[5, 6, 7], [8]])) == "tokenized"


def test_detection_prefers_prompt_then_messages_then_input_ids():
    both = datasets.Dataset.from_dict({"input_ids": [[5, 6]], "messages": [user("hi")], "prompt": ["hi"]})
    assert detect_prompt_format(both) == "text"
    assert detect_prompt_format(both.remove_columns("prompt")) == "conversational"
    assert detect_prompt_format(both.remove_columns(["prompt", "messages"])) == "tokenized"


def test_detection_errors():
    with pytest.raises(ValueError, match=r"0 rows \(columns: \['prompt'\]\)"):
        detect_prompt_format(datasets.Dataset.from_dict({"prompt": []}))
    with pytest.raises(ValueError, match=r"columns \['answer', 'question'\] hold no prompts") as info:
        detect_prompt_format(datasets.Dataset.from_dict({"question": ["q"], "answer": ["a"]}))
    assert "Accepted prompt formats" in str(info.value) and "rename_column" in str(info.value)
    with pytest.raises(
        ValueError, match=r"column 'prompt' .*holds int \(3\).*a string \(text format\)"
    ) as info:
        detect_prompt_format(datasets.Dataset.from_dict({"prompt": [3]}))
    assert "tokenized: column 'input_ids'" in str(info.value)
    with pytest.raises(ValueError, match=r"column 'messages' .*holds str.*list of \{\"role\", \"content\"\}"):
        detect_prompt_format(datasets.Dataset.from_dict({"messages": ["hi"]}))
    # Non-int ids: one float makes Arrow store the whole column as floats.
    with pytest.raises(ValueError, match=r"column 'input_ids' .*list of float.*list of int token ids"):
        detect_prompt_format(ids_dataset([[1, 2], [1.5]]))
    with pytest.raises(TypeError, match=r"pick one, e\.g\. dataset\[\"train\"\]"):
        detect_prompt_format(datasets.DatasetDict({"train": ids_dataset([[1]])}))


# --------------------------------------------------------------------------------------------------
# Tokenization
# --------------------------------------------------------------------------------------------------


def test_text_ids_are_the_tokenizers_and_columns_are_kept(kit, tokenizer):
    ds = kit.prompt_dataset("test", n=6)
    ds = ds.add_column("reference", [f"ref {i}" for i in range(6)])
    out, stats = tokenize_prompts(ds, tokenizer)
    assert out.column_names == ["prompt", "reference", "input_ids"]
    assert out["prompt"][:] == ds["prompt"][:] and out["reference"][:] == ds["reference"][:]
    assert out["input_ids"][:] == [tokenizer(p)["input_ids"] for p in ds["prompt"]]
    assert out.features["input_ids"] == datasets.List(datasets.Value("int64"))
    lengths = [len(tokenizer(p)["input_ids"]) for p in ds["prompt"]]
    assert stats == PromptTokenizationStats(
        format="text", num_rows=6, num_truncated=0, max_prompt_length=None, longest=max(lengths)
    )


def test_text_ids_include_bos_when_the_tokenizer_adds_it(kit, bos_tokenizer):
    ds = kit.prompt_dataset("test", n=3)
    out, _ = tokenize_prompts(ds, bos_tokenizer)
    assert out["input_ids"][:] == [bos_tokenizer(p)["input_ids"] for p in ds["prompt"]]
    assert all(ids[0] == bos_tokenizer.bos_token_id for ids in out["input_ids"])


def test_text_replaces_an_existing_input_ids_column(tokenizer):
    ds = datasets.Dataset.from_dict({"prompt": ["the movie was"], "input_ids": [[999, 998]]})
    out, stats = tokenize_prompts(ds, tokenizer)
    assert stats.format == "text"
    assert out["input_ids"][0] == tokenizer("the movie was")["input_ids"]


@pytest.mark.parametrize("column", ["prompt", "messages"])
def test_conversational_ids_are_the_chat_templates(kit, tokenizer, column):
    ds = kit.prompt_dataset("test", n=4, chat=True)
    if column != "prompt":
        ds = ds.rename_column("prompt", column)
    system = [{"role": "system", "content": "be kind"}]
    ds = ds.add_item({column: system + user("my city was")})
    out, stats = tokenize_prompts(ds, tokenizer)
    assert stats.format == "conversational" and stats.num_rows == 5
    assert out.column_names == [column, "input_ids"]
    assert out[column][:] == ds[column][:]
    for messages, ids in zip(ds[column], out["input_ids"], strict=True):
        expected = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if hasattr(expected, "keys"):  # transformers 5: a BatchEncoding
            expected = expected["input_ids"]
        assert ids == list(expected)
        # The kit template ends the prompt by opening the assistant turn.
        assert ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")


def test_left_truncation_keeps_the_last_tokens_and_counts(tokenizer):
    prompts = ["the movie was", "they said the hotel was really", "a"]
    full = [tokenizer(p)["input_ids"] for p in prompts]
    limit = len(full[0])  # the first prompt fits exactly, the second is longer, the third shorter
    assert len(full[1]) > limit > len(full[2])
    out, stats = tokenize_prompts(
        datasets.Dataset.from_dict({"prompt": prompts}), tokenizer, max_prompt_length=limit
    )
    assert out["input_ids"][:] == [full[0], full[1][-limit:], full[2]]
    assert stats.num_truncated == 1 and stats.max_prompt_length == limit and stats.longest == len(full[1])


def test_left_truncation_keeps_a_leading_bos(kit, bos_tokenizer):
    ds = kit.prompt_dataset("test", n=8)
    full = [bos_tokenizer(p)["input_ids"] for p in ds["prompt"]]
    out, stats = tokenize_prompts(ds, bos_tokenizer, max_prompt_length=3)
    bos = bos_tokenizer.bos_token_id
    assert out["input_ids"][:] == [ids if len(ids) <= 3 else [bos, *ids[-2:]] for ids in full]
    assert stats.num_truncated == sum(len(ids) > 3 for ids in full) > 0
    assert stats.longest == max(len(ids) for ids in full)


def test_tokenized_ids_are_validated_kept_and_truncated(tokenizer):
    bos = tokenizer.bos_token_id
    ds = ids_dataset([[bos, 10, 11, 12, 13], [20, 21, 22, 23], [30]], label=[1, 2, 3])
    out, stats = tokenize_prompts(ds, tokenizer, max_prompt_length=3, vocab_size=len(tokenizer))
    assert out["input_ids"][:] == [[bos, 12, 13], [21, 22, 23], [30]]
    assert out["label"][:] == [1, 2, 3]
    assert stats == PromptTokenizationStats(
        format="tokenized", num_rows=3, num_truncated=2, max_prompt_length=3, longest=5
    )
    # Without a tokenizer no BOS is known: a plain cut.
    out, _ = tokenize_prompts(ds, None, max_prompt_length=3)
    assert out["input_ids"][0] == [11, 12, 13]


def test_rows_stay_in_order_after_select_and_results_are_deterministic(kit, tokenizer):
    ds = kit.prompt_dataset("test", n=10).select([7, 2, 9, 0])
    first, stats = tokenize_prompts(ds, tokenizer, max_prompt_length=4)
    second, _ = tokenize_prompts(ds, tokenizer, max_prompt_length=4)
    assert first["prompt"][:] == ds["prompt"][:]
    assert first["input_ids"][:] == [tokenizer(p)["input_ids"][-4:] for p in ds["prompt"]]
    assert first["input_ids"][:] == second["input_ids"][:]
    assert stats.num_truncated == sum(len(tokenizer(p)["input_ids"]) > 4 for p in ds["prompt"])


@pytest.mark.parametrize("fmt", ["text", "tokenized"])
def test_file_backed_and_in_memory_datasets_tokenize_alike(kit, tokenizer, tmp_path, fmt):
    # In-memory datasets are tokenized without datasets.map; file-backed ones (load_dataset, load_from_disk)
    # through map, which caches to disk: the two paths give the same rows, columns and statistics.
    prompts = [*kit.prompt_dataset("train", n=40)["prompt"], "x " * 30]
    if fmt == "text":
        columns = {"prompt": prompts, "n": list(range(len(prompts)))}
    else:
        columns = {"input_ids": [tokenizer(p)["input_ids"] for p in prompts], "n": list(range(len(prompts)))}
    in_memory = datasets.Dataset.from_dict(columns).shuffle(seed=1)
    in_memory.save_to_disk(str(tmp_path / "ds"))
    on_disk = datasets.load_from_disk(str(tmp_path / "ds"))
    assert not in_memory.cache_files and on_disk.cache_files
    a, stats_a = tokenize_prompts(in_memory, tokenizer, max_prompt_length=8)
    b, stats_b = tokenize_prompts(on_disk, tokenizer, max_prompt_length=8)
    assert stats_a == stats_b and stats_a.num_truncated >= 1
    assert sorted(a.column_names) == sorted(b.column_names)
    assert a.features["input_ids"] == b.features["input_ids"]
    for name in a.column_names:
        assert a[name] == b[name], name


def test_conversation_ending_with_assistant_is_an_error(tokenizer):
    ds = datasets.Dataset.from_dict(
        {"messages": [user("hi"), [*user("the movie was"), {"role": "assistant", "content": " good"}]]}
    )
    with pytest.raises(
        ValueError, match=r"row 1: the conversation in column 'messages' ends with an assistant"
    ) as e:
        tokenize_prompts(ds, tokenizer)
    assert "user or system turn" in str(e.value) and "[:-1]" in str(e.value)


def test_empty_prompts_are_errors_with_the_row(tokenizer):
    text = datasets.Dataset.from_dict({"prompt": ["the movie was", "good", ""]})
    with pytest.raises(ValueError, match=r"row 2: the prompt has 0 tokens \('prompt' tokenizes to nothing\)"):
        tokenize_prompts(text, tokenizer)
    with pytest.raises(
        ValueError, match=r"row 1: the prompt has 0 tokens \(column 'input_ids' is an empty list\)"
    ):
        tokenize_prompts(ids_dataset([[5], []]), None)


def test_missing_values_are_errors_with_the_row(tokenizer):
    with pytest.raises(ValueError, match=r"row 1: column 'prompt' is missing \(None\)"):
        tokenize_prompts(datasets.Dataset.from_dict({"prompt": ["a", None]}), tokenizer)
    with pytest.raises(ValueError, match=r"row 1: column 'input_ids' is missing \(None\)"):
        tokenize_prompts(ids_dataset([[5], None]), None)


def test_out_of_vocabulary_id_is_an_error(tokenizer):
    vocab = len(tokenizer)
    with pytest.raises(
        ValueError, match=rf"row 1: token id {vocab} is outside the vocabulary \(vocab_size={vocab}"
    ):
        tokenize_prompts(ids_dataset([[5, 6], [7, vocab]]), tokenizer, vocab_size=vocab)
    with pytest.raises(ValueError, match=r"row 0: token id -1 is outside the vocabulary"):
        tokenize_prompts(ids_dataset([[-1]]), None, vocab_size=vocab)
    # Text prompts are checked too: a vocabulary smaller than the tokenizer's.
    with pytest.raises(ValueError, match=r"row 0: token id \d+ is outside the vocabulary \(vocab_size=10,"):
        tokenize_prompts(datasets.Dataset.from_dict({"prompt": ["the movie was"]}), tokenizer, vocab_size=10)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_prompt_length": 0}, r"max_prompt_length=0: must be a positive integer"),
        ({"max_prompt_length": -3}, r"max_prompt_length=-3: must be a positive integer"),
        ({"max_prompt_length": 2.5}, r"max_prompt_length=2.5: must be a positive integer"),
        ({"vocab_size": 0}, r"vocab_size=0: must be a positive integer"),
        ({"num_proc": 0}, r"num_proc=0: must be a positive integer or None"),
    ],
)
def test_bad_arguments(tokenizer, kwargs, message):
    with pytest.raises(ValueError, match=message):
        tokenize_prompts(ids_dataset([[5]]), tokenizer, **kwargs)


def test_tokenizer_needed_for_text_and_chat(kit, tokenizer):
    with pytest.raises(ValueError, match=r"tokenizer=None, but the prompts are text \(column 'prompt'\)"):
        tokenize_prompts(kit.prompt_dataset("test", n=2), None)
    chat = kit.prompt_dataset("test", n=2, chat=True)
    with pytest.raises(ValueError, match=r"tokenizer=None, but the prompts are conversational"):
        tokenize_prompts(chat, None)
    no_template = copy.deepcopy(tokenizer)
    no_template.chat_template = None
    with pytest.raises(ValueError, match=r"the tokenizer has no chat template"):
        tokenize_prompts(chat, no_template)


# --------------------------------------------------------------------------------------------------
# Collation
# --------------------------------------------------------------------------------------------------


def test_collator_left_pads_and_passes_other_keys_through():
    rows = [
        {"prompt": "a", "input_ids": [5, 6, 7], "messages": user("a"), "label": 1},
        {"prompt": "b", "input_ids": [8], "messages": user("b"), "label": 2},
        {"prompt": "c", "input_ids": torch.tensor([9, 10]), "messages": user("c"), "label": 3},
    ]
    batch = PromptCollator(pad_token_id=1)(rows)
    assert list(batch) == ["input_ids", "attention_mask", "prompt", "messages", "label"]
    assert batch["input_ids"].dtype == torch.long and batch["attention_mask"].dtype == torch.long
    assert batch["input_ids"].tolist() == [[5, 6, 7], [1, 1, 8], [1, 9, 10]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    assert batch["prompt"] == ["a", "b", "c"]
    assert batch["messages"] == [user("a"), user("b"), user("c")]
    assert batch["label"] == [1, 2, 3]


def test_collator_pad_to_multiple_of_and_replaces_attention_mask():
    rows = [{"input_ids": [5, 6, 7], "attention_mask": [9, 9, 9]}, {"input_ids": [8], "attention_mask": [9]}]
    batch = PromptCollator(pad_token_id=0, pad_to_multiple_of=4)(rows)
    assert batch["input_ids"].tolist() == [[0, 5, 6, 7], [0, 0, 0, 8]]
    assert batch["attention_mask"].tolist() == [[0, 1, 1, 1], [0, 0, 0, 1]]
    assert set(batch) == {"input_ids", "attention_mask"}
    assert PromptCollator(0, pad_to_multiple_of=3)([{"input_ids": [1, 2, 3]}])["input_ids"].shape == (1, 3)


def test_collator_errors():
    with pytest.raises(ValueError, match=r"pad_token_id=None: must be an int \(tokenizer.pad_token_id\)"):
        PromptCollator(pad_token_id=None)
    with pytest.raises(ValueError, match=r"pad_to_multiple_of=0: must be a positive integer"):
        PromptCollator(0, pad_to_multiple_of=0)
    collator = PromptCollator(0)
    with pytest.raises(ValueError, match=r"empty list of rows"):
        collator([])
    with pytest.raises(ValueError, match=r"no 'input_ids'; tokenize the dataset first"):
        collator([{"prompt": "a"}])
    with pytest.raises(
        ValueError, match=r"row 1 has keys \['input_ids'\], but row 0 has \['input_ids', 'prompt'\]"
    ):
        collator([{"input_ids": [1], "prompt": "a"}, {"input_ids": [2]}])
    with pytest.raises(ValueError, match=r"row 1 has input_ids of shape \(0,\)"):
        collator([{"input_ids": [1]}, {"input_ids": []}])


def test_tokenized_prompts_through_a_dataloader(kit, tokenizer):
    ds, _ = tokenize_prompts(kit.prompt_dataset("test", n=5, chat=True), tokenizer)
    loader = torch.utils.data.DataLoader(ds, batch_size=3, collate_fn=PromptCollator(tokenizer.pad_token_id))
    batch = next(iter(loader))
    assert batch["input_ids"].shape[0] == 3 and batch["prompt"] == ds["prompt"][:3]
    for row, ids in enumerate(ds["input_ids"][:3]):
        n = len(ids)
        assert batch["input_ids"][row, -n:].tolist() == ids
        assert batch["attention_mask"][row].sum().item() == n
        assert (batch["input_ids"][row, :-n] == tokenizer.pad_token_id).all()


def test_num_proc_gives_the_same_result(kit, tokenizer):
    ds = kit.prompt_dataset("test", n=12, chat=True)
    parallel, parallel_stats = tokenize_prompts(ds, tokenizer, max_prompt_length=6, num_proc=2)
    serial, serial_stats = tokenize_prompts(ds, tokenizer, max_prompt_length=6)
    assert parallel["input_ids"][:] == serial["input_ids"][:]
    assert parallel_stats == serial_stats and serial_stats.num_truncated > 0
