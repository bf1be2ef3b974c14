"""Loading and preparing the models of an RLHF run.

Reward (and, later, value) models are one-label sequence-classification models: a transformer whose
head maps the hidden state of the last real token to a scalar (N-implementation-details: the reward
model scores query + response and the reward is read at its last token). This module turns what a
user has (a path, a Hub id, a model instance, a causal-LM checkpoint) into such a model, initialises a
freshly created head the way LHPD does, turns dropout off, and carries the reward-normalization
gain and bias in the model's config.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .compat import has_loaded_adapter
from .distributed import gathered
from .model_paths import check_model_path

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Where the reward normalization travels: attributes of the model's config (saved in config.json),
# and, because a PEFT adapter folder has no config.json of the base model, a small JSON file beside
# the weights that `load_reward_model` reads back.
REWARD_GAIN_ATTR = "reward_gain"
REWARD_BIAS_ATTR = "reward_bias"
REWARD_NORMALIZATION_FILE = "reward_normalization.json"

# Names transformers uses for the scalar head of sequence-classification models.
_HEAD_NAMES = ("score", "classifier", "v_head", "summary")


def _is_peft_model(model: Any) -> bool:
    if "peft" not in sys.modules:  # never imported: no PeftModel can exist (and importing costs ~9 MiB)
        return False
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - a broken install
        return False
    return isinstance(model, PeftModel)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Inside the context torch's generators (CPU and CUDA) start from ``seed``; outside, they are as
    before. For initialisations that must follow the config's seed (a new adapter's weights are drawn
    before ``Trainer`` seeds the process) without moving the caller's random stream."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def require_peft(purpose: str) -> None:
    """Raise a clear ImportError when PEFT (an optional dependency: the ``peft`` extra) is missing."""
    try:
        import peft  # noqa: F401
    except ImportError as err:
        raise ImportError(
            f"{purpose} needs PEFT, which is not installed. Install it with "
            "`pip install 'rlhf_trainers[peft]'` (or `pip install peft`)."
        ) from err


def _base(model: Any) -> PreTrainedModel:
    """The transformers model under a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if _is_peft_model(model) else model


def has_peft_adapter(model: Any) -> bool:
    """Whether `model` already carries a PEFT adapter: a ``PeftModel``, or a transformers model whose
    adapter was loaded with ``load_adapter`` (or ``from_pretrained`` of an adapter folder)."""
    return _is_peft_model(model) or has_loaded_adapter(model)


def tokenizer_of(
    model: Any, processing_class: PreTrainedTokenizerBase | None, what: str
) -> PreTrainedTokenizerBase:
    """``processing_class``, or the tokenizer saved with ``model`` when it is a path; refused when it is
    missing for a model instance, or not a tokenizer. ``what`` names it in the error."""
    from transformers import PreTrainedTokenizerBase

    if processing_class is None:
        if not isinstance(model, (str, os.PathLike)):
            raise ValueError(
                f"processing_class ({what}) is required when model is an instance; pass "
                "processing_class=AutoTokenizer.from_pretrained(<model path>)."
            )
        from transformers import AutoTokenizer

        check_model_path(model, "model")
        processing_class = AutoTokenizer.from_pretrained(model)
    if not isinstance(processing_class, PreTrainedTokenizerBase):
        raise TypeError(
            f"processing_class must be a tokenizer (PreTrainedTokenizerBase), got {type(processing_class).__name__}."
        )
    return processing_class


def embedding_rows(model: Any) -> int:
    """Rows of the model's input embedding table: the token ids it can read are ``0..rows - 1``."""
    embeddings = _base(model).get_input_embeddings()
    weight = getattr(embeddings, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] > 0:
        return int(weight.shape[0])
    # ZeRO-3 partitions the weight (a flat, possibly empty shard); nn.Embedding keeps the full count.
    return int(embeddings.num_embeddings)


def readable_pad_id(pad_token_id: int | None, rows: int) -> int | None:
    """The id that padding positions hold in the input of a model with ``rows`` input embeddings: the pad
    id itself where the model has a row for it, else 0.

    The reference implementation, and the RLOO blog's snippet, add a ``[PAD]`` token to a tokenizer
    without one (``tokenizer.add_special_tokens({"pad_token": "[PAD]"})``) and do not resize the model's
    embeddings, so the pad id has no row; they replace pad ids by 0 before every forward pass. The
    padding positions are masked out of attention, so the id they hold changes no output at a real token.
    """
    if pad_token_id is None or 0 <= pad_token_id < rows:
        return pad_token_id
    return 0


def readable_ids(ids: torch.Tensor, pad_token_id: int | None, rows: int) -> torch.Tensor:
    """``ids`` as a model with ``rows`` input embeddings can read them: every pad id replaced by
    :func:`readable_pad_id` where the model has no embedding row for it; ``ids`` itself otherwise (no copy).

    Only the pad id is replaced: any other id past the table is still an error of the caller's, raised by
    the embedding lookup. The positions holding the pad id must be masked out of attention."""
    fill = readable_pad_id(pad_token_id, rows)
    if fill == pad_token_id:
        return ids
    return ids.masked_fill(ids == pad_token_id, fill)


def score_head_module(model: nn.Module) -> tuple[str, nn.Module]:
    """The output head of a sequence-classification model as a module, whatever wraps it (a PEFT
    ``ModulesToSaveWrapper`` too): ``(attribute name, module)``.

    Raises:
        ValueError: if no head with one of the usual names (``score``, ``classifier``, ...) exists.
    """
    base = _base(model)
    for name in _HEAD_NAMES:
        head = getattr(base, name, None)
        if isinstance(head, nn.Module):
            return name, head
    raise ValueError(
        f"{type(base).__name__} has no scalar head named one of {_HEAD_NAMES}; pass a model created with "
        "AutoModelForSequenceClassification (num_labels=1)."
    )


def pooled_scores(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    pad_token_id: int | None,
    *,
    call: Any = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Pooled logits (B, num_labels) of a sequence-classification model: its head's output at each row's
    last real token (the last position ``attention_mask`` keeps; rows may be padded on either side).

    Where the model has an embedding row for the pad id this is the model's own output: transformers reads
    it at the rightmost token that is not ``config.pad_token_id``, which :func:`align_pad_token` set to the
    pad id. Where it has none (a ``[PAD]`` token added without resizing, see :func:`readable_pad_id`), the
    pad ids are replaced by 0 (:func:`readable_ids`), which transformers could no longer tell from a real
    token 0, so the head's per-token output is taken (a forward hook on the head) and read at the last
    position the mask keeps, as the reference implementation reads its reward.

    Args:
        model: the sequence-classification model (under a PEFT wrapper too); gives the embedding rows and
            the head.
        input_ids: (B, T) ids padded with ``pad_token_id``.
        attention_mask: (B, T) 1 at real tokens.
        pad_token_id: the id the rows are padded with.
        call: replaces ``model.__call__`` (a DDP or DeepSpeed wrapper of it).
        kwargs: passed to the call (e.g. ``position_ids``).

    Raises:
        ValueError: with a pad id past the embedding table, if the head is not applied per token (its
            output is not (B, T, num_labels)).
    """
    call = call if call is not None else model
    rows = embedding_rows(model)
    if readable_pad_id(pad_token_id, rows) == pad_token_id:
        return call(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits
    name, head = score_head_module(model)
    captured: list[torch.Tensor] = []
    handle = head.register_forward_hook(lambda _module, _args, output: captured.append(output))
    config = _base(model).config
    # transformers refuses batches of more than one row without config.pad_token_id; the pooled output it
    # computes from it is not used here.
    unset = getattr(config, "pad_token_id", None) is None
    try:
        if unset:
            config.pad_token_id = 0
        call(input_ids=readable_ids(input_ids, pad_token_id, rows), attention_mask=attention_mask, **kwargs)
    finally:
        handle.remove()
        if unset:
            config.pad_token_id = None
    per_token = captured[-1] if captured else None
    if (
        not isinstance(per_token, torch.Tensor)
        or per_token.dim() != 3
        or per_token.shape[:2] != input_ids.shape
    ):
        raise ValueError(
            f"The pad token id ({pad_token_id}) is outside the {type(_base(model)).__name__}'s vocabulary "
            f"({rows} token embeddings), so its score is read from the head's per-token output at the last "
            f"real token; but its head ({name!r}) is not applied to every token. Call "
            "model.resize_token_embeddings(len(tokenizer)) so that the pad token has an embedding."
        )
    columns = torch.arange(input_ids.shape[1], device=attention_mask.device)
    last = torch.where(attention_mask.bool(), columns, -1).max(-1).values.clamp(min=0)
    rows_index = torch.arange(per_token.shape[0], device=per_token.device)
    return per_token[rows_index, last.to(per_token.device)]


def context_length(model: Any) -> int | None:
    """Most positions the model was built for (``config.max_position_embeddings``, GPT-2's ``n_positions``),
    or None when its config does not say."""
    value = getattr(getattr(_base(model), "config", None), "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def check_fits_context(length: int, models: dict[str, Any], *, given: str, fix: str) -> None:
    """ValueError unless sequences of `length` tokens fit the context of every model of `models`.

    Args:
        length: the longest sequence the models will see.
        models: what each model is called in the message (e.g. "policy") -> the model (None: skipped).
        given: how `length` comes about, for the message (e.g. "the longest prompt (12) + response_length
            (250)").
        fix: what to change, for the message.
    """
    for name, model in models.items():
        limit = context_length(model) if model is not None else None
        if limit is not None and length > limit:
            raise ValueError(
                f"{given} = {length} tokens, but the {name} has {limit} positions "
                f"(config.max_position_embeddings): longer sequences index past its position table, or, "
                f"with rotary positions, run at positions it was never trained on. {fix}"
            )


def check_reads_ids(model: Any, vocab_size: int, what: str, fix: str) -> None:
    """ValueError unless `model` can read every token id below `vocab_size` (the policy's vocabulary).

    The reference, value and (same-tokenizer) reward models read the policy's sampled token ids as they
    are, so their embedding tables must cover the policy's: a smaller one fails at the first rollout
    with an index error (or a CUDA device-side assert), long after construction.
    """
    rows = embedding_rows(model)
    if rows < vocab_size:
        raise ValueError(
            f"The {what} has {rows} token embeddings but the policy's vocabulary has {vocab_size}: it reads "
            f"the policy's token ids, and ids {rows}..{vocab_size - 1} would index past its embedding table "
            f"(were its vocabularies made by different tokenizers?). {fix}"
        )


def find_score_head(model: nn.Module) -> tuple[str, nn.Linear]:
    """The scalar output head of a sequence-classification model: ``(attribute name, nn.Linear)``.

    Raises:
        ValueError: if no head with one of the usual names (``score``, ``classifier``, ...) exists.
    """
    base = _base(model)
    for name in _HEAD_NAMES:
        head = getattr(base, name, None)
        if isinstance(head, nn.Linear):
            return name, head
        inner = getattr(head, "out_proj", None) or getattr(head, "dense", None)
        if isinstance(head, nn.Module) and isinstance(inner, nn.Linear):
            return name, inner
    raise ValueError(
        f"{type(base).__name__} has no scalar head named one of {_HEAD_NAMES}; pass a model created with "
        "AutoModelForSequenceClassification (num_labels=1)."
    )


def init_reward_head(model: nn.Module, generator: torch.Generator | None = None) -> None:
    """Initialise the scalar head as LHPD does: weight ~ N(0, 1/sqrt(d_model + 1)), bias 0.

    N-implementation-details, "Reward head initialization": the std 1/sqrt(d_model + 1) keeps the
    initial rewards of order one whatever the width of the model.
    """
    _, head = find_score_head(model)
    params = [head.weight] + ([head.bias] if head.bias is not None else [])
    with gathered(*params, modify=True), torch.no_grad():
        d_model = head.weight.shape[-1]
        std = 1.0 / math.sqrt(d_model + 1)
        sample = torch.randn(head.weight.shape, generator=generator, dtype=torch.float32) * std
        head.weight.copy_(sample.to(head.weight.dtype))
        if head.bias is not None:
            head.bias.zero_()


def disable_dropout(model: nn.Module) -> int:
    """Set every dropout probability to 0 (modules and config fields); returns how many modules changed.

    N-implementation-details, "Disable dropout": with dropout the log-probabilities of the rollout and
    of the training forward pass differ, and the reward model scores the same text differently.
    """
    changed = 0
    for module in model.modules():
        if isinstance(module, nn.Dropout) and module.p != 0:
            module.p = 0.0
            changed += 1
    config = getattr(_base(model), "config", None)
    if config is not None:
        for key, value in list(vars(config).items()):
            if "dropout" in key and isinstance(value, float) and value != 0:
                setattr(config, key, 0.0)
    return changed


def get_reward_normalization(model: Any) -> tuple[float, float]:
    """``(gain, bias)`` stored in the model's config; ``(1.0, 0.0)`` when the model was never normalized."""
    config = _base(model).config
    return float(getattr(config, REWARD_GAIN_ATTR, 1.0)), float(getattr(config, REWARD_BIAS_ATTR, 0.0))


def set_reward_normalization(model: Any, gain: float, bias: float) -> None:
    """Store the normalization in the model's config: ``reward = raw * gain + bias`` from now on."""
    if not (math.isfinite(gain) and math.isfinite(bias)) or gain <= 0:
        raise ValueError(
            f"reward normalization needs a finite gain > 0 and a finite bias, got {gain}, {bias}."
        )
    config = _base(model).config
    setattr(config, REWARD_GAIN_ATTR, float(gain))
    setattr(config, REWARD_BIAS_ATTR, float(bias))


def write_reward_normalization(model: Any, output_dir: str | os.PathLike[str]) -> None:
    """Write ``reward_normalization.json`` (gain, bias) into ``output_dir``."""
    gain, bias = get_reward_normalization(model)
    path = Path(output_dir) / REWARD_NORMALIZATION_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"gain": gain, "bias": bias}, indent=2) + "\n")
    os.replace(tmp, path)


def _read_reward_normalization(path: str | os.PathLike[str]) -> tuple[float, float] | None:
    file = Path(path) / REWARD_NORMALIZATION_FILE
    if not file.is_file():
        return None
    data = json.loads(file.read_text())
    return float(data["gain"]), float(data["bias"])


def check_one_label(model: Any, what: str = "reward model") -> None:
    """Raise a clear error unless ``model`` is a sequence-classification model with one label."""
    base = _base(model)
    name = type(base).__name__
    if not name.endswith("ForSequenceClassification") and not hasattr(base, "score"):
        raise ValueError(
            f"The {what} must be a sequence-classification model with one label, got {name}. Pass a path "
            "(a causal-LM checkpoint is converted, with a new scalar head) or a model created with "
            "AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)."
        )
    num_labels = getattr(base.config, "num_labels", 1)
    if num_labels != 1:
        raise ValueError(
            f"The {what} must output one scalar, but its config has num_labels={num_labels}. Load it with "
            "AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, "
            "ignore_mismatched_sizes=True) to replace the head with a scalar one."
        )


def load_reward_model(
    model: str | os.PathLike[str] | PreTrainedModel,
    *,
    dtype: torch.dtype | str | None = None,
    init_head: bool = True,
    seed: int = 0,
    model_kwargs: dict[str, Any] | None = None,
) -> tuple[PreTrainedModel, bool]:
    """A one-label sequence-classification model from a path, a Hub id or an instance.

    A causal-LM checkpoint (its config lists only ``...ForCausalLM`` architectures) is loaded into the
    matching ``...ForSequenceClassification`` class, or, for an architecture transformers has no such
    class for, into a :class:`~rlhf_trainers.score_head.ScoreHeadModel` (its base model and a scalar
    head): the transformer weights are reused and the scalar head is new. A new head is initialised as LHPD does (:func:`init_reward_head`) when
    ``init_head`` is true; a head that was loaded from the checkpoint is never touched. A
    ``reward_normalization.json`` beside the weights (written by :class:`RewardTrainer`) is read back
    into the config.

    Returns:
        ``(model, head_is_new)``.
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification

    if not isinstance(model, (str, os.PathLike)):
        check_one_label(model)
        return model, False
    kwargs = dict(model_kwargs or {})
    check_model_path(model, "reward model", model_kwargs=kwargs)
    if dtype is not None:
        kwargs["dtype"] = dtype
    if (Path(model) / "adapter_config.json").is_file():
        return _load_adapter_folder(model, kwargs), False
    config = AutoConfig.from_pretrained(
        model, **{k: v for k, v in kwargs.items() if k == "trust_remote_code"}
    )
    architectures = getattr(config, "architectures", None) or []
    is_classifier = any(a.endswith("ForSequenceClassification") for a in architectures)
    if is_classifier and getattr(config, "num_labels", 1) != 1:
        raise ValueError(
            f"{model} is a sequence-classification checkpoint with num_labels={config.num_labels}; a reward "
            "model outputs one scalar. Pass model_kwargs={'num_labels': 1, 'ignore_mismatched_sizes': True} "
            "to replace its head, or train from the causal-LM checkpoint instead."
        )
    kwargs.setdefault("num_labels", 1)
    from .score_head import has_sequence_classification_class

    if not has_sequence_classification_class(config):
        loaded, head_is_new = _load_score_head_model(model, config, kwargs)
        return _finish_reward_model(model, loaded, head_is_new, init_head=init_head, seed=seed)
    from transformers.utils import logging as hf_logging

    # transformers prints a load report listing the new head as MISSING: expected here, and said
    # more usefully by our own log line below.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*newly initialized.*")
            loaded, info = AutoModelForSequenceClassification.from_pretrained(
                model, output_loading_info=True, **kwargs
            )
    finally:
        hf_logging.set_verbosity(verbosity)
    head_name, _ = find_score_head(loaded)
    missing = list(info.get("missing_keys", []))
    mismatched = [k[0] if isinstance(k, tuple) else k for k in info.get("mismatched_keys", [])]
    head_is_new = any(k.split(".")[0] == head_name for k in missing + mismatched)
    return _finish_reward_model(model, loaded, head_is_new, init_head=init_head, seed=seed)


def _load_score_head_model(
    path: str | os.PathLike[str], config: Any, kwargs: dict[str, Any]
) -> tuple[PreTrainedModel, bool]:
    """``(model, head_is_new)`` for an architecture without a sequence-classification class in
    transformers: a folder saved from a :class:`~rlhf_trainers.score_head.ScoreHeadModel` loads as one; a
    causal-LM checkpoint gives its backbone (whatever the attribute it lives under) a new scalar head."""
    from transformers import AutoModelForCausalLM

    from .score_head import SCORE_HEAD_ARCHITECTURE, ScoreHeadModel, score_head_model_from_backbone

    kwargs = {k: v for k, v in kwargs.items() if k != "num_labels"}
    if SCORE_HEAD_ARCHITECTURE in (getattr(config, "architectures", None) or []):
        return ScoreHeadModel.from_pretrained(path, config=config, **kwargs), False
    causal_lm = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    config = causal_lm.config
    config.architectures = None
    backbone = getattr(causal_lm, causal_lm.base_model_prefix)
    return score_head_model_from_backbone(backbone, config), True


def _finish_reward_model(
    model: str | os.PathLike[str], loaded: PreTrainedModel, head_is_new: bool, *, init_head: bool, seed: int
) -> tuple[PreTrainedModel, bool]:
    """Initialise a new head (logged) and read the stored reward normalization back."""
    head_name, _ = find_score_head(loaded)
    if head_is_new:
        logger.info(
            "%s: new scalar head '%s' on the %s backbone (%s)",
            model,
            head_name,
            type(loaded).__name__,
            "initialised N(0, 1/sqrt(d_model + 1))" if init_head else "transformers' default init",
        )
    if head_is_new and init_head:
        init_reward_head(loaded, torch.Generator().manual_seed(seed))
    stored = _read_reward_normalization(model) if Path(model).is_dir() else None
    if stored is not None:
        set_reward_normalization(loaded, *stored)
    return loaded, head_is_new


def _load_adapter_folder(path: str | os.PathLike[str], kwargs: dict[str, Any]) -> PreTrainedModel:
    """A PEFT folder saved by RewardTrainer: base model + adapter + trained head, merged for inference."""
    require_peft(f"Loading the adapter folder {path}")
    from peft import AutoPeftModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    from .compat import quiet_peft_model_init

    kwargs = {k: v for k, v in kwargs.items() if k != "num_labels"}
    # The base model loads first, its score head "MISSING" in transformers' load report; the adapter
    # folder then restores the trained head (modules_to_save): the report would only mislead.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with quiet_peft_model_init():
            peft_model = AutoPeftModelForSequenceClassification.from_pretrained(
                str(path), num_labels=1, **kwargs
            )
    finally:
        hf_logging.set_verbosity(verbosity)
    merged = peft_model.merge_and_unload()
    check_one_label(merged)
    stored = _read_reward_normalization(path)
    if stored is not None:
        set_reward_normalization(merged, *stored)
    tokenizer_file = Path(path) / "tokenizer_config.json"
    if tokenizer_file.is_file():
        pad = json.loads(tokenizer_file.read_text()).get("pad_token")
        if pad is not None:
            from transformers import AutoTokenizer

            align_pad_token(merged, AutoTokenizer.from_pretrained(str(path)))
    return merged


def align_pad_token(model: Any, tokenizer: PreTrainedTokenizerBase, what: str = "reward model") -> None:
    """Make the model pool at the tokenizer's pad token.

    Sequence-classification models find "the last real token" by looking for ``config.pad_token_id``;
    with another id there the reward is read at the wrong position, silently. A pad id past the model's
    embedding table (the reference implementation's ``[PAD]``, added without resizing) is not written
    to the config (transformers would refuse to load the saved model: the embedding's ``padding_idx``
    must be a row): :func:`pooled_scores` then reads the score at the last real token itself.

    Raises:
        ValueError: if the tokenizer has no pad token (with the fix).
    """
    if tokenizer.pad_token_id is None:
        raise ValueError(
            f"The tokenizer of the {what} has no pad token. Add a dedicated one (LHPD pads with a token "
            "distinct from EOS): tokenizer.add_special_tokens({'pad_token': '<|pad|>'}) followed by "
            "model.resize_token_embeddings(len(tokenizer)). Setting tokenizer.pad_token = tokenizer.eos_token "
            "also works for reward modeling, but then the score is read at the last token before the final EOS."
        )
    if readable_pad_id(tokenizer.pad_token_id, embedding_rows(model)) != tokenizer.pad_token_id:
        return
    config = _base(model).config
    if getattr(config, "pad_token_id", None) != tokenizer.pad_token_id:
        config.pad_token_id = tokenizer.pad_token_id


def check_pad_token_use(
    tokenizer: PreTrainedTokenizerBase,
    *,
    reward_model_reads_ids: bool,
    stop_token_ids: list[int],
    truncate_after: int,
    prompts_with_pad: dict[str, int | None],
) -> None:
    """The on-policy trainers' rules for a pad token that may also be a real token.

    The policy, reference and value models get explicit attention masks, so for them padding is never
    mistaken for text. A reward model that scores the policy's token ids (same tokenizer) is different:
    it finds the real tokens as those that are not the pad id (:func:`rlhf_trainers.rewards.score_ids`).

    - A prompt holding a dedicated pad token (not also EOS, BOS or UNK): error, the prompts look padded
      already (the trainer pads each batch itself).
    - A prompt holding a pad token that is also EOS, BOS or UNK, with a reward model on the ids: error,
      the reward model would skip that token.
    - pad == EOS with a reward model on the ids, when EOS can be an ordinary token of a response (no stop
      at EOS: ``stop_token=None`` or another ``stop_token_id``; or ``truncate_after > 0``): error.
    - pad == EOS with a reward model on the ids, responses ending at their first EOS: a warning; the final
      EOS is then never scored (``RewardTrainer`` reads the score there too when its tokenizer pads with
      EOS), which works.

    Args:
        tokenizer: the policy's tokenizer (with a pad token).
        reward_model_reads_ids: a reward model scores the policy's token ids as they are.
        stop_token_ids: the ids that end a response ([] for fixed-length responses).
        truncate_after: stop tokens only count from this response index on.
        prompts_with_pad: dataset name ("train", "eval") -> first row whose prompt holds the pad id, or None.

    Raises:
        ValueError: in the error cases above, naming the dataset and row, or the settings, and the fix.
    """
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    dedicated_fix = (
        "Give the tokenizer a dedicated pad token: tokenizer.add_special_tokens({'pad_token': '<|pad|>'}), "
        "then model.resize_token_embeddings(len(tokenizer)) for the policy (and the reward model)."
    )
    others = {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("eos", "bos", "unk")}
    also = [name.upper() for name, value in others.items() if value is not None and value == pad]
    for name, row in prompts_with_pad.items():
        if row is None:
            continue
        if not also:
            raise ValueError(
                f"{name} dataset, row {row}: the prompt holds the pad token (id {pad}), so the prompts look "
                "padded already. Give them unpadded (without pad ids): the trainer pads each batch itself, on "
                "the left."
            )
        if reward_model_reads_ids:
            raise ValueError(
                f"{name} dataset, row {row}: the prompt holds token id {pad}, which is both the pad token and "
                f"the {'/'.join(also)} token. The reward model scores the policy's token ids and takes every "
                f"pad id for padding, so it would skip this token and score another sequence than the one "
                f"generated. {dedicated_fix}"
            )
    if not reward_model_reads_ids or eos is None or pad != eos:
        return
    reasons = []
    if eos not in stop_token_ids:
        reasons.append(
            "responses do not stop at EOS (stop_token=None or another stop_token_id), so EOS is an ordinary "
            "token inside them"
        )
    if truncate_after > 0:
        reasons.append(f"truncate_after={truncate_after}: EOS tokens before that index are ordinary tokens")
    if reasons:
        raise ValueError(
            f"The tokenizer's pad token is its EOS token (id {eos}) and {'; and '.join(reasons)}. The reward "
            "model scores the policy's token ids and takes every pad id for padding, so it would skip those "
            f"EOS tokens and score another sequence than the one generated. {dedicated_fix} Or stop responses "
            "at their first EOS (stop_token='eos', truncate_after=0), or score with reward functions only."
        )
    logger.warning(
        "The tokenizer's pad token is its EOS token (id %d): the reward model reads its score at the last "
        "token that is not padding, so the EOS that ends a response is never scored, only the tokens before "
        "it (RewardTrainer reads it there too when its tokenizer pads with EOS). A dedicated pad token "
        "avoids this.",
        eos,
    )


def check_onpolicy_models(
    policy: Any,
    tokenizer: PreTrainedTokenizerBase,
    *,
    prompts: dict[str, Any],
    response_length: int,
    stop_token_ids: list[int],
    truncate_after: int,
    ref_model: Any = None,
    value_model: Any = None,
    reward_model: Any = None,
    reward_model_reads_ids: bool = False,
    value_model_from_reward_model: bool = False,
) -> None:
    """What the models and prompts of a PPO/RLOO run must agree on, checked before any work.

    - The value model, and a reward model that scores the policy's token ids, read the policy's ids: their
      embedding tables must cover the policy's vocabulary (:func:`check_reads_ids`); a value model copied
      from a reward model that has its own tokenizer would read ids of another vocabulary.
    - The longest prompt (already truncated to ``max_prompt_length``) plus ``response_length`` must fit
      the context of every model that sees prompt + response (:func:`check_fits_context`).
    - The pad token rules of :func:`check_pad_token_use`.

    Args:
        policy: the policy (a causal LM, or a PeftModel).
        tokenizer: the policy's tokenizer.
        prompts: dataset name ("train", "eval") -> the tokenized prompt dataset (an ``input_ids`` column).
        response_length, stop_token_ids, truncate_after: the generation settings.
        ref_model, value_model, reward_model: the other models, or None.
        reward_model_reads_ids: the reward model scores the policy's token ids (same tokenizer).
        value_model_from_reward_model: the value model is a copy of the reward model
            (``value_model_init="reward_model"``).

    Raises:
        ValueError: saying what does not fit and how to fix it.
    """
    from .data import first_row_with_token, longest_sequence

    vocab = embedding_rows(policy)
    if value_model_from_reward_model and reward_model is not None and not reward_model_reads_ids:
        raise ValueError(
            "value_model_init='reward_model' copies the reward model, whose tokenizer "
            "(reward_processing_class) is not the policy's: the value model reads the policy's token ids, "
            "which its vocabulary does not hold. Use value_model_init='policy', or pass value_model= (a "
            "one-label sequence-classification model on the policy's tokenizer)."
        )
    if value_model is not None:
        check_reads_ids(
            value_model,
            vocab,
            "value model",
            "Use a value model on the policy's tokenizer (value_model_init='policy' builds one from the policy).",
        )
    if reward_model is not None and reward_model_reads_ids:
        check_reads_ids(
            reward_model,
            vocab,
            "reward model",
            "If it has its own tokenizer, pass it as reward_processing_class=: the reward model then scores the "
            "completions' text, re-tokenized.",
        )
    longest = max((longest_sequence(ds, "input_ids") for ds in prompts.values()), default=0)
    check_fits_context(
        longest + response_length,
        {
            "policy": policy,
            "reference model": ref_model,
            "value model": value_model,
            "reward model": reward_model if reward_model_reads_ids else None,
        },
        given=f"the longest prompt ({longest} tokens, after max_prompt_length) + response_length "
        f"({response_length})",
        fix="Set max_prompt_length (longer prompts keep their last tokens) or lower response_length so that "
        "their sum fits.",
    )
    pad = tokenizer.pad_token_id
    check_pad_token_use(
        tokenizer,
        reward_model_reads_ids=reward_model is not None and reward_model_reads_ids,
        stop_token_ids=stop_token_ids,
        truncate_after=truncate_after,
        prompts_with_pad={name: first_row_with_token(ds, "input_ids", pad) for name, ds in prompts.items()},
    )
