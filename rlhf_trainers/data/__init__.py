"""Datasets to tokens: preference pairs for the reward model, prompts for the on-policy trainers.

Preference data
---------------
A preference dataset holds, per row, a *chosen* and a *rejected* version of the same text. Four layouts
(:data:`PREFERENCE_FORMATS`) are accepted; :func:`detect_preference_format` tells them apart from the
column names and the type of the first row's values:

=================  ===========================================  ============================================
format             columns                                      values
=================  ===========================================  ============================================
``explicit``       prompt, chosen, rejected                     strings; ``prompt + chosen`` is the full text
``implicit``       chosen, rejected                             strings, each the full text
``conversational`` chosen, rejected (+ optional prompt)         lists of ``{"role", "content"}`` messages
``tokenized``      input_ids_chosen, input_ids_rejected         lists of token ids, used as given
=================  ===========================================  ============================================

Every format may also have a numeric ``margin`` column (how much better chosen is than rejected), used
by the margin variant of the pairwise loss. Other columns are ignored.

:func:`tokenize_preferences` turns any of them into ``input_ids_chosen``, ``input_ids_rejected`` (unpadded)
and ``margin``, and :class:`PreferenceCollator` pads a list of such rows into one batch holding the chosen
sequences and then the rejected ones, so that a single forward pass scores both.

Prompt data
-----------
PPO and RLOO generate their own completions, so they only need prompts. Three layouts
(:data:`PROMPT_FORMATS`) are accepted; :func:`detect_prompt_format` looks at the column ``prompt``, else
``messages``, else ``input_ids``:

=================  ==========================  ===============================================================
format             column                      values
=================  ==========================  ===============================================================
``text``           prompt                      strings
``conversational`` prompt (or messages)        lists of ``{"role", "content"}`` messages, not ending with an
                                               assistant turn
``tokenized``      input_ids                   lists of token ids, used as given
=================  ==========================  ===============================================================

:func:`tokenize_prompts` adds (or, for ``tokenized``, validates) an ``input_ids`` column and keeps every
other column, so reward functions still see the prompt text and any extra columns (e.g. a reference
answer). :class:`PromptCollator` left-pads ``input_ids`` for generation and passes the other columns
through as lists.

The package: :mod:`.preferences` (preference pairs), :mod:`.prompts` (prompts) and :mod:`.common` (the
checks, chat templates, padding and truncation both share).
"""

from .common import first_row_with_token, longest_sequence
from .preferences import (
    LONG_PAIR_POLICIES,
    PREFERENCE_FORMATS,
    PreferenceCollator,
    PreferenceTokenizationStats,
    detect_preference_format,
    tokenize_preferences,
)
from .prompts import (
    PROMPT_FORMATS,
    PromptCollator,
    PromptTokenizationStats,
    detect_prompt_format,
    tokenize_prompts,
)

__all__ = [
    "LONG_PAIR_POLICIES",
    "PREFERENCE_FORMATS",
    "PROMPT_FORMATS",
    "PreferenceCollator",
    "PreferenceTokenizationStats",
    "PromptCollator",
    "PromptTokenizationStats",
    "detect_preference_format",
    "detect_prompt_format",
    "first_row_with_token",
    "longest_sequence",
    "tokenize_preferences",
    "tokenize_prompts",
]
