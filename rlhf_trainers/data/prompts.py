"""Prompts to tokens: format detection, :func:`tokenize_prompts` and :class:`PromptCollator` (the
formats are described in :mod:`rlhf_trainers.data`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    import datasets
    from transformers import PreTrainedTokenizerBase


from .common import (
    apply_chat_template,
    check_dataset_type,
    check_messages,
    check_padding_args,
    check_present,
    check_prompt_args,
    check_strings,
    check_vocabulary,
    describe,
    is_message_list,
    is_token_id,
    padded_length,
    truncate_left,
)

#: Prompt formats (see the module docstring): strings, chat messages, or token ids.
PROMPT_FORMATS: tuple[str, ...] = ("text", "conversational", "tokenized")


_PROMPT_COLUMNS = ("prompt", "messages", "input_ids")


_LENGTH_COLUMN = "__rlhf_trainers_prompt_length__"


#: Rows per tokenizer call when an in-memory dataset is tokenized without ``map`` (map's default batch).
_TOKENIZE_BATCH = 1000


_ACCEPTED_PROMPT_FORMATS = (
    "Accepted prompt formats (the first of the columns 'prompt', 'messages', 'input_ids' is used):\n"
    "  text: column 'prompt' of strings\n"
    "  conversational: column 'prompt' or 'messages' of lists of {\"role\", \"content\"} messages, ending "
    "with a user or system turn\n"
    "  tokenized: column 'input_ids' of lists of int token ids"
)


def _prompt_column(dataset: datasets.Dataset, data_format: str) -> str:
    """The column that holds the prompts of a dataset in format `data_format`."""
    if data_format == "tokenized":
        return "input_ids"
    return "prompt" if "prompt" in dataset.column_names else "messages"


def detect_prompt_format(dataset: datasets.Dataset) -> str:
    """The prompt format of `dataset`: one of :data:`PROMPT_FORMATS`.

    The prompts are read from the column ``prompt`` if there is one, else ``messages``, else
    ``input_ids`` (so a dataset with both text prompts and ids is "text", and its ids are replaced by
    :func:`tokenize_prompts`). The type of the first row's value then decides: a string is "text"
    (``prompt`` only), a non-empty list of ``{"role", "content"}`` dicts is "conversational", a list of
    ints is "tokenized" (``input_ids`` only). Arrow stores one type per column, so the first row stands for
    all rows; :func:`tokenize_prompts` checks every row and reports bad ones with their index.

    Args:
        dataset: a ``datasets.Dataset`` (one split).

    Returns:
        "text", "conversational" or "tokenized".

    Raises:
        TypeError: `dataset` is a ``DatasetDict`` (pick a split) or not a ``datasets.Dataset``.
        ValueError: the dataset is empty, has none of the prompt columns, or its prompt column holds
            values of another type; the message names the columns and lists the accepted formats.
    """
    check_dataset_type(dataset)
    columns = sorted(dataset.column_names)
    if len(dataset) == 0:
        raise ValueError(
            f"the prompt dataset has 0 rows (columns: {columns}); nothing to generate from. Pass a dataset "
            "with at least one prompt (check the split you picked, or a filter that removed every row)."
        )
    column = next((c for c in _PROMPT_COLUMNS if c in columns), None)
    if column is None:
        raise ValueError(
            f"the dataset's columns {columns} hold no prompts: none of 'prompt', 'messages', 'input_ids' is "
            "present.\n" + _ACCEPTED_PROMPT_FORMATS + "\nRename the prompt column with "
            "dataset.rename_column(old, 'prompt')."
        )
    value = dataset[0][column]
    if column == "input_ids":
        if isinstance(value, list) and all(is_token_id(i) for i in value):
            return "tokenized"
        expected = "a list of int token ids (tokenized format)"
    elif column == "prompt" and isinstance(value, str):
        return "text"
    elif is_message_list(value):
        return "conversational"
    elif column == "prompt":
        expected = (
            'a string (text format) or a non-empty list of {"role", "content"} messages (conversational '
            "format); token ids go in a column 'input_ids'"
        )
    else:
        expected = 'a non-empty list of {"role", "content"} messages (conversational format)'
    raise ValueError(
        f"column {column!r} (of columns {columns}): the first row holds {describe(value)}, but {expected} "
        "is expected.\n" + _ACCEPTED_PROMPT_FORMATS
    )


@dataclass
class PromptTokenizationStats:
    """What :func:`tokenize_prompts` did.

    Attributes:
        format: the detected format, one of :data:`PROMPT_FORMATS`.
        num_rows: rows in the dataset (the output has the same rows).
        num_truncated: prompts longer than `max_prompt_length` whose start was cut.
        max_prompt_length: the limit applied (None: no limit).
        longest: tokens in the longest prompt, before truncation.
    """

    format: str
    num_rows: int
    num_truncated: int
    max_prompt_length: int | None
    longest: int


def _check_prompt_conversations(values: Sequence[Any], column: str, indices: list[int]) -> None:
    for value, index in zip(values, indices, strict=True):
        if not is_message_list(value):
            raise ValueError(
                f"row {index}: column {column!r} holds {describe(value)}, expected a non-empty list of "
                '{"role", "content"} messages.'
            )
        check_messages(value, index, column)
        if value[-1]["role"] == "assistant":
            raise ValueError(
                f"row {index}: the conversation in column {column!r} ends with an assistant message, but a "
                "prompt must end with a user or system turn (the policy writes the assistant's answer; "
                "add_generation_prompt=True opens it). If the rows are full conversations, drop the last "
                f"turn: dataset.map(lambda row: {{{column!r}: row[{column!r}][:-1]}})."
            )


def _chat_template_ids(result: Any) -> list[list[int]]:
    """The ids of a batched ``apply_chat_template(..., tokenize=True)`` call, whatever it returned.

    transformers 5 returns a ``BatchEncoding`` (``return_dict=True`` is its default), older versions a
    list of id lists.
    """
    if isinstance(result, Mapping):
        result = result["input_ids"]
    if hasattr(result, "tolist"):
        result = result.tolist()
    return [list(seq) for seq in result]


def _checked_prompt_ids(ids: Any, index: int, column: str, vocab_size: int | None) -> list[int]:
    """`ids` as a list of ints; ValueError naming row `index` if it is not one, is empty or leaves the vocab."""
    if not isinstance(ids, (list, tuple)) or not all(is_token_id(i) for i in ids):
        raise ValueError(
            f"row {index}: the token ids of column {column!r} are {describe(ids)}, expected a list of ints."
        )
    if len(ids) == 0:
        what = (
            "column 'input_ids' is an empty list"
            if column == "input_ids"
            else f"{column!r} tokenizes to nothing"
        )
        raise ValueError(
            f"row {index}: the prompt has 0 tokens ({what}); every prompt needs at least one. "
            "Remove empty prompts first, e.g. with dataset.filter."
        )
    check_vocabulary(ids, index, column, vocab_size, "policy")
    return [int(i) for i in ids]


def _check_prompt_tokenizer(
    dataset: datasets.Dataset, data_format: str, column: str, tokenizer: PreTrainedTokenizerBase | None
) -> None:
    """Refuse a missing tokenizer or chat template where the format needs one, and a reserved column."""
    if data_format != "tokenized" and tokenizer is None:
        raise ValueError(
            f"tokenizer=None, but the prompts are {data_format} (column {column!r}) and must be tokenized. Pass the "
            "policy's tokenizer, or give the dataset a column 'input_ids' of token ids (and no 'prompt' or "
            "'messages' column)."
        )
    if data_format == "conversational" and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the prompts are conversational (column {column!r} holds lists of messages) but the tokenizer has "
            "no chat template. Set tokenizer.chat_template to a Jinja template (e.g. the one of the model's "
            "instruct version), or give the prompts as strings in a column 'prompt'."
        )
    if _LENGTH_COLUMN in dataset.column_names:
        raise ValueError(f"the dataset has a column {_LENGTH_COLUMN!r}, a name reserved here; rename it.")


@dataclass
class _PromptTokenizer:
    """The batch function of :func:`tokenize_prompts`: prompts of one batch of rows to checked token ids.

    Returns ``input_ids`` (truncated to `max_prompt_length`) and, under ``_LENGTH_COLUMN``, each prompt's
    length before truncation. A module-level class rather than a closure, so that ``num_proc > 1`` can
    pickle it.
    """

    data_format: str
    column: str
    tokenizer: Any
    max_prompt_length: int | None
    vocab_size: int | None
    bos_id: int | None
    chat_template_kwargs: dict[str, Any] | None = None

    def __call__(self, batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        values = batch[self.column]
        check_present(values, self.column, indices)
        out: dict[str, list[Any]] = {"input_ids": [], _LENGTH_COLUMN: []}
        for ids, index in zip(self._ids(values, indices), indices, strict=True):
            ids = _checked_prompt_ids(ids, index, self.column, self.vocab_size)
            out[_LENGTH_COLUMN].append(len(ids))
            if self.max_prompt_length is not None:
                ids = truncate_left(ids, self.max_prompt_length, self.bos_id)
            out["input_ids"].append(ids)
        return out

    def _ids(self, values: list[Any], indices: list[int]) -> list[Any]:
        """The token ids of `values` as the format gives them (not yet checked)."""
        if self.data_format == "text":
            check_strings(values, self.column, indices)
            return self.tokenizer(values, add_special_tokens=True, return_attention_mask=False)["input_ids"]
        if self.data_format == "conversational":
            _check_prompt_conversations(values, self.column, indices)
            return _chat_template_ids(
                apply_chat_template(
                    self.tokenizer,
                    values,
                    indices,
                    tokenize=True,
                    add_generation_prompt=True,
                    **(self.chat_template_kwargs or {}),
                )
            )
        return values


def _tokenize_in_memory(
    dataset: datasets.Dataset, prompt_tokenizer: _PromptTokenizer
) -> tuple[datasets.Dataset, list[int]]:
    """`dataset` with its ``input_ids`` column made by `prompt_tokenizer`, and the untruncated lengths.

    For an in-memory dataset (from_dict, from_list, ...): the same batches as ``map`` would make, the ids
    added as a column. map's function fingerprinting and Arrow writer cost ~3 MiB of resident memory and
    buy nothing here (no cache file is written for an in-memory dataset).
    """
    import datasets

    source = dataset.with_format(None).select_columns([prompt_tokenizer.column])
    ids_column: list[list[int]] = []
    lengths: list[int] = []
    for start in range(0, len(dataset), _TOKENIZE_BATCH):
        stop = min(start + _TOKENIZE_BATCH, len(dataset))
        out = prompt_tokenizer(source[start:stop], list(range(start, stop)))
        ids_column += out["input_ids"]
        lengths += out[_LENGTH_COLUMN]
    ids_feature = datasets.List(datasets.Value("int64"))
    others = [name for name in dataset.column_names if name != "input_ids"]
    if others:
        tokenized = dataset.select_columns(others).add_column("input_ids", ids_column, feature=ids_feature)
    else:  # a table without columns has no rows to add a column to
        features = datasets.Features({"input_ids": ids_feature})
        tokenized = datasets.Dataset.from_dict({"input_ids": ids_column}, features=features)
    return tokenized, lengths


def _tokenize_with_map(
    dataset: datasets.Dataset, prompt_tokenizer: _PromptTokenizer, num_proc: int | None
) -> tuple[datasets.Dataset, list[int]]:
    """`dataset` mapped through `prompt_tokenizer` (cached on disk for a file-backed dataset), and the
    untruncated lengths."""
    import datasets

    features = dataset.features.copy()
    features["input_ids"] = datasets.List(datasets.Value("int64"))
    features[_LENGTH_COLUMN] = datasets.Value("int64")
    tokenized = dataset.map(
        prompt_tokenizer,
        batched=True,
        with_indices=True,
        features=features,
        num_proc=num_proc,
        desc=f"Tokenizing prompts ({prompt_tokenizer.data_format})",
    )
    # map writes a new table without indices mapping, so its Arrow column is the rows in order; reading it
    # there avoids iterating a datasets Column (one formatted row at a time, ~100x slower).
    lengths = tokenized.data.column(_LENGTH_COLUMN).to_pylist()
    return tokenized.remove_columns(_LENGTH_COLUMN), lengths


def tokenize_prompts(
    dataset: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase | None,
    *,
    max_prompt_length: int | None = None,
    vocab_size: int | None = None,
    num_proc: int | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> tuple[datasets.Dataset, PromptTokenizationStats]:
    """Token ids for the prompts of a PPO/RLOO dataset in any of :data:`PROMPT_FORMATS`.

    Per format (:func:`detect_prompt_format`):

    - text: ``tokenizer(prompt, add_special_tokens=True)``, i.e. exactly ``tokenizer(prompt)``, so a
      tokenizer that adds BOS adds it here too.
    - conversational: ``tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)``:
      the template's text plus the opening of the assistant turn, which the policy then completes. A
      conversation that already ends with an assistant message is an error.
    - tokenized: the ``input_ids`` as given (checked).

    A prompt longer than `max_prompt_length` keeps its last `max_prompt_length` tokens (the end of a prompt,
    next to where generation starts, matters most); if it started with ``tokenizer.bos_token_id`` that
    token stays in front of the last ``max_prompt_length - 1``. Without a tokenizer (tokenized format
    only) no BOS is known and the cut is plain.

    Args:
        dataset: one split, in any of :data:`PROMPT_FORMATS`.
        tokenizer: the policy's tokenizer (with a chat template for conversational prompts). May be None
            for the tokenized format.
        max_prompt_length: most tokens per prompt (>= 1), or None for no limit.
        vocab_size: if given, every id must be in ``[0, vocab_size)`` (e.g. the size of the policy's
            input embeddings), which catches prompts tokenized with another tokenizer.
        num_proc: processes for ``dataset.map`` (None: this process). An in-memory dataset with
            ``num_proc=None`` is tokenized in this process without ``map`` (no cache file to write).
        chat_template_kwargs: more keywords of ``apply_chat_template`` for conversational prompts (e.g.
            ``tools=``, the tools' schemas, when the policy may call tools).

    Returns:
        ``(tokenized, stats)``. `tokenized` has the rows of `dataset` in the same order and all its columns
        (the ``prompt``/``messages`` column too, for reward functions that want the prompt text), plus
        ``input_ids``: lists of int64 ids, unpadded (for "text" and "conversational" a column of that name
        is replaced). `stats` gives the format, counts and the longest prompt.

    Raises:
        ValueError: bad arguments, no tokenizer (or no chat template) where one is needed, a missing value,
            a prompt of 0 tokens, non-int ids, ids outside `vocab_size`, a conversation ending with an
            assistant message (all with the row index), and everything :func:`detect_prompt_format` raises.
    """
    check_prompt_args(max_prompt_length, vocab_size, num_proc)
    data_format = detect_prompt_format(dataset)
    column = _prompt_column(dataset, data_format)
    _check_prompt_tokenizer(dataset, data_format, column, tokenizer)
    prompt_tokenizer = _PromptTokenizer(
        data_format=data_format,
        column=column,
        tokenizer=tokenizer,
        max_prompt_length=max_prompt_length,
        vocab_size=vocab_size,
        bos_id=getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None,
        chat_template_kwargs=chat_template_kwargs,
    )
    if num_proc is None and not dataset.cache_files:
        tokenized, lengths = _tokenize_in_memory(dataset, prompt_tokenizer)
    else:
        tokenized, lengths = _tokenize_with_map(dataset, prompt_tokenizer, num_proc)
    stats = PromptTokenizationStats(
        format=data_format,
        num_rows=len(dataset),
        num_truncated=0 if max_prompt_length is None else sum(n > max_prompt_length for n in lengths),
        max_prompt_length=max_prompt_length,
        longest=max(lengths),
    )
    return tokenized, stats


class PromptCollator:
    """Left-pads tokenized prompts for generation, passing the other columns through.

    Generation appends to the right of every row, so prompts are padded on the left: the last prompt
    token of every row sits in the last column and the completions line up.

    Args:
        pad_token_id: the id written into padding positions (``tokenizer.pad_token_id``).
        pad_to_multiple_of: round the padded length T up to a multiple of this (e.g. 8 for tensor cores).

    Calling it on a list of B rows (dicts with the same keys, each with ``input_ids``: a list or 1-D tensor
    of ids, as :func:`tokenize_prompts` makes them) returns:

    - ``input_ids``: (B, T) long, each row's ids at the right end, `pad_token_id` before them.
    - ``attention_mask``: (B, T) long, 1 on real tokens, 0 on padding.
    - every other key of the rows (``prompt``, ``messages``, extra columns for reward functions): a Python
      list of the B values, in row order. An ``attention_mask`` key of the rows is replaced, not passed on.

    T is the longest prompt of the batch (rounded up to `pad_to_multiple_of`).
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None) -> None:
        check_padding_args(pad_token_id, pad_to_multiple_of)
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = pad_to_multiple_of

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(pad_token_id={self.pad_token_id}, "
            f"pad_to_multiple_of={self.pad_to_multiple_of})"
        )

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        """Left-pad `features` (B rows) into ``input_ids`` and ``attention_mask`` (B, T); other keys as lists."""
        if len(features) == 0:
            raise ValueError("PromptCollator got an empty list of rows.")
        keys = list(features[0])
        if "input_ids" not in keys:
            raise ValueError(
                f"PromptCollator: the rows have keys {keys} but no 'input_ids'; tokenize the dataset first "
                "with rlhf_trainers.data.tokenize_prompts."
            )
        for row, feature in enumerate(features):
            if set(feature) != set(keys):
                raise ValueError(
                    f"PromptCollator: row {row} has keys {sorted(feature)}, but row 0 has {sorted(keys)}; "
                    "all rows of a batch need the same keys."
                )
        sequences = [torch.as_tensor(f["input_ids"], dtype=torch.long) for f in features]
        for row, seq in enumerate(sequences):
            if seq.dim() != 1 or len(seq) == 0:
                raise ValueError(
                    f"PromptCollator: row {row} has input_ids of shape {tuple(seq.shape)}; each row needs a "
                    "non-empty 1-D sequence of ids."
                )
        lengths = [len(s) for s in sequences]
        length = padded_length(lengths, self.pad_to_multiple_of)
        input_ids = torch.full((len(sequences), length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
        for row, (seq, n) in enumerate(zip(sequences, lengths, strict=True)):
            input_ids[row, length - n :] = seq
            attention_mask[row, length - n :] = 1
        batch: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
        for key in keys:
            if key not in batch:
                batch[key] = [f[key] for f in features]
        return batch
