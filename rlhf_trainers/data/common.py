"""What the preference and prompt pipelines share: checks of the dataset, of value types, of messages
and of token ids against the vocabulary; chat templates; padding and truncation; and the length and
token scans of a tokenized dataset."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import datasets
    from transformers import PreTrainedTokenizerBase


#: A prompt as a dataset holds it: a string, or chat messages (``{"role": ..., "content": ...}``).
Prompt = str | list[dict[str, str]]


def describe(value: Any) -> str:
    """Type of `value` for error messages, with a short preview: "int (3)", "list of int ([1, 2, ...])"."""
    preview = repr(value)
    if len(preview) > 60:
        preview = preview[:57] + "..."
    kind = type(value).__name__
    if isinstance(value, list) and value:
        kind = f"list of {type(value[0]).__name__}"
    return f"{kind} ({preview})"


def is_message_list(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )


def check_dataset_type(dataset: Any) -> None:
    """TypeError unless `dataset` is one split (a ``datasets.Dataset``)."""
    import datasets

    if isinstance(dataset, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        splits = list(dataset.keys())
        example = splits[0] if splits else "train"
        raise TypeError(
            f"expected one split (a datasets.Dataset), got a {type(dataset).__name__} with splits {splits}; "
            f'pick one, e.g. dataset["{example}"].'
        )
    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(
            f"expected a datasets.Dataset, got {type(dataset).__name__}. Build one with "
            "datasets.Dataset.from_dict / from_list (an IterableDataset is not supported here)."
        )


def truncate_left(ids: list[int], max_length: int, bos_id: int | None) -> list[int]:
    """The last `max_length` ids of `ids`; a leading BOS stays in front of the last ``max_length - 1``."""
    if len(ids) <= max_length:
        return ids
    if bos_id is not None and ids[0] == bos_id:
        return [bos_id, *ids[len(ids) - max_length + 1 :]]
    return ids[len(ids) - max_length :]


def check_present(values: Sequence[Any], column: str, indices: list[int]) -> None:
    for value, index in zip(values, indices, strict=True):
        if value is None:
            raise ValueError(
                f"row {index}: column {column!r} is missing (None). Remove or fill such rows first, e.g. "
                f"dataset.filter(lambda row: row[{column!r}] is not None)."
            )


def check_strings(values: Sequence[Any], column: str, indices: list[int]) -> None:
    for value, index in zip(values, indices, strict=True):
        if not isinstance(value, str):
            raise ValueError(
                f"row {index}: column {column!r} holds {describe(value)}, expected a string. Convert or "
                "remove that row, e.g. with dataset.map or dataset.filter."
            )


def check_padding_args(pad_token_id: Any, pad_to_multiple_of: Any) -> None:
    if (
        pad_token_id is None
        or not isinstance(pad_token_id, numbers.Integral)
        or isinstance(pad_token_id, bool)
    ):
        raise ValueError(
            f"pad_token_id={pad_token_id!r}: must be an int (tokenizer.pad_token_id). If the tokenizer has no "
            "pad token, add one: tokenizer.add_special_tokens({'pad_token': '<|pad|>'})."
        )
    if pad_to_multiple_of is not None and (
        not isinstance(pad_to_multiple_of, numbers.Integral) or pad_to_multiple_of < 1
    ):
        raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of!r}: must be a positive integer or None.")


def padded_length(lengths: list[int], pad_to_multiple_of: int | None) -> int:
    length = max(lengths)
    if pad_to_multiple_of is not None:
        length = math.ceil(length / pad_to_multiple_of) * pad_to_multiple_of
    return length


def is_token_id(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_prompt_args(max_prompt_length: Any, vocab_size: Any, num_proc: Any) -> None:
    if max_prompt_length is not None and (not is_token_id(max_prompt_length) or max_prompt_length < 1):
        raise ValueError(
            f"max_prompt_length={max_prompt_length!r}: must be a positive integer (longer prompts keep their "
            "last max_prompt_length tokens), or None for no limit."
        )
    if vocab_size is not None and (not is_token_id(vocab_size) or vocab_size < 1):
        raise ValueError(
            f"vocab_size={vocab_size!r}: must be a positive integer (e.g. the policy's "
            "model.get_input_embeddings().num_embeddings), or None to skip the id check."
        )
    if num_proc is not None and (not is_token_id(num_proc) or num_proc < 1):
        raise ValueError(f"num_proc={num_proc!r}: must be a positive integer or None.")


def check_messages(messages: list[dict[str, Any]], index: int, column: str) -> None:
    """ValueError naming the row and message unless each message has a role (a non-empty string) and a
    content (a string, or a list of parts such as ``{"type": "text", "text": ...}``).

    Arrow stores a column of messages as structs with the union of the keys of all rows, so a message
    that lacks "content" (or "role") in one row reads as None there; a chat template would render it
    as "None" or as nothing, without a word.
    """
    for position, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(
                f"row {index}: message {position} of column {column!r} has role {role!r}; every message needs "
                "a role, a non-empty string such as 'system', 'user' or 'assistant'. Fix or remove that row."
            )
        if not isinstance(content, (str, list)):
            raise ValueError(
                f"row {index}: message {position} (role {role!r}) of column {column!r} has content "
                f"{describe(content)}; every message needs a content: a string (may be empty), or a list of "
                'parts like {"type": "text", "text": "..."}. Fix or remove that row.'
            )


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase, conversations: list[Any], indices: list[int], **kwargs: Any
) -> Any:
    """``tokenizer.apply_chat_template`` over a batch; when the template fails, a ValueError names the
    first row it fails on (templates raise on roles or orders they do not accept)."""
    try:
        return tokenizer.apply_chat_template(conversations, **kwargs)
    except Exception:  # jinja2 TemplateError, or whatever the template's filters raise
        for conversation, index in zip(conversations, indices, strict=True):
            try:
                tokenizer.apply_chat_template([conversation], **kwargs)
            except Exception as row_err:
                raise ValueError(
                    f"row {index}: the tokenizer's chat template fails on this conversation "
                    f"({type(row_err).__name__}: {row_err}); roles: {[m.get('role') for m in conversation]}. "
                    "Fix or remove that row, or use a chat template that accepts these messages."
                ) from row_err
        raise


def check_vocabulary(ids: Sequence[int], index: int, column: str, vocab_size: int | None, model: str) -> None:
    """ValueError naming row `index` if an id of `ids` is outside ``[0, vocab_size)`` (None: no check)."""
    if vocab_size is None:
        return
    for i in ids:
        if not 0 <= i < vocab_size:
            raise ValueError(
                f"row {index}: token id {i} is outside the vocabulary (vocab_size={vocab_size}, valid ids "
                f"0..{vocab_size - 1}) of the {model}, in column {column!r}: the text was tokenized with another "
                f"tokenizer than the {model}'s. Tokenize it with the {model}'s tokenizer, or, if tokens were "
                "added to that tokenizer, call model.resize_token_embeddings(len(tokenizer))."
            )


def token_column(dataset: datasets.Dataset, column: str) -> Any:
    """The Arrow list array of `column` over the dataset's rows, in order (honours select/shuffle)."""
    if column not in dataset.column_names:
        raise ValueError(f"the dataset has no column {column!r} (columns: {dataset.column_names}).")
    return dataset.with_format("arrow")[column].combine_chunks()


def longest_sequence(dataset: datasets.Dataset, *columns: str) -> int:
    """Tokens in the longest sequence of the list-of-ids `columns` (e.g. ``"input_ids"``); 0 when empty.

    Reads the Arrow lengths, without decoding any row, so it costs little on large datasets.
    """
    import pyarrow.compute as pc

    longest = 0
    for column in columns:
        value = pc.max(pc.list_value_length(token_column(dataset, column))).as_py()
        longest = max(longest, value or 0)
    return longest


def first_row_with_token(dataset: datasets.Dataset, column: str, token_id: int) -> int | None:
    """Index of the first row whose list of ids in `column` contains `token_id`, or None.

    Used to find prompts that already hold the pad token (padded by the user, or an EOS that is also
    the pad token), which batching could not tell from padding.
    """
    import pyarrow.compute as pc

    ids = token_column(dataset, column)
    hit = pc.index(pc.equal(pc.list_flatten(ids), token_id), True).as_py()
    if hit < 0:
        return None
    return int(pc.list_parent_indices(ids)[hit].as_py())
