"""Loading and preparing the models of an RLHF run.

Reward (and, later, value) models are one-label sequence-classification models: a transformer whose
head maps the hidden state of the last real token to a scalar (N-implementation-details: the reward
model scores query + response and the reward is read at its last token). This module turns what a
user has (a path, a Hub id, a model instance, a causal-LM checkpoint) into such a model, initialises a
freshly created head the way the seed does, turns dropout off, and carries the reward-normalization
gain and bias in the model's config.
"""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

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
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def _base(model: Any) -> PreTrainedModel:
    """The transformers model under a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if _is_peft_model(model) else model


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


def _gathered(params: list[nn.Parameter], modify: bool):
    """Context that makes ZeRO-3 partitioned parameters whole (a no-op without DeepSpeed)."""
    import contextlib

    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=0 if modify else None)
    return contextlib.nullcontext()


def init_reward_head(model: nn.Module, generator: torch.Generator | None = None) -> None:
    """Initialise the scalar head as the seed does: weight ~ N(0, 1/sqrt(d_model + 1)), bias 0.

    N-implementation-details, "Reward head initialization": the std 1/sqrt(d_model + 1) keeps the
    initial rewards of order one whatever the width of the model.
    """
    _, head = find_score_head(model)
    params = [head.weight] + ([head.bias] if head.bias is not None else [])
    with _gathered(params, modify=True), torch.no_grad():
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
    matching ``...ForSequenceClassification`` class: the transformer weights are reused and the scalar
    head is new. A new head is initialised as the seed does (:func:`init_reward_head`) when
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
    from peft import AutoPeftModelForSequenceClassification

    kwargs = {k: v for k, v in kwargs.items() if k != "num_labels"}
    merged = AutoPeftModelForSequenceClassification.from_pretrained(
        str(path), num_labels=1, **kwargs
    ).merge_and_unload()
    check_one_label(merged)
    stored = _read_reward_normalization(path)
    if stored is not None:
        set_reward_normalization(merged, *stored)
    tokenizer_file = Path(path) / "tokenizer_config.json"
    if tokenizer_file.is_file():
        pad = json.loads(tokenizer_file.read_text()).get("pad_token")
        if pad is not None:
            from transformers import AutoTokenizer

            merged.config.pad_token_id = AutoTokenizer.from_pretrained(str(path)).pad_token_id
    return merged


def align_pad_token(model: Any, tokenizer: PreTrainedTokenizerBase, what: str = "reward model") -> None:
    """Make the model pool at the tokenizer's pad token.

    Sequence-classification models find "the last real token" by looking for ``config.pad_token_id``;
    with another id there the reward is read at the wrong position, silently.

    Raises:
        ValueError: if the tokenizer has no pad token (with the fix).
    """
    if tokenizer.pad_token_id is None:
        raise ValueError(
            f"The tokenizer of the {what} has no pad token. Add a dedicated one (the seed pads with a token "
            "distinct from EOS): tokenizer.add_special_tokens({'pad_token': '<|pad|>'}) followed by "
            "model.resize_token_embeddings(len(tokenizer)). Setting tokenizer.pad_token = tokenizer.eos_token "
            "also works for reward modeling, but then EOS tokens inside a sequence end it early."
        )
    config = _base(model).config
    if getattr(config, "pad_token_id", None) != tokenizer.pad_token_id:
        config.pad_token_id = tokenizer.pad_token_id
