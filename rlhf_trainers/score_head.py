"""A one-label scorer on any causal LM's backbone, for architectures that transformers gives no
``...ForSequenceClassification`` class (Cohere, for one).

PPO's value model and a reward model built from a causal-LM checkpoint are one-label
sequence-classification models. Where transformers has such a class for the config, that class is
used (:func:`rlhf_trainers.models.load_reward_model`, ``value_model_from_policy``); otherwise
:class:`ScoreHeadModel` is: the architecture's base model (``AutoModel``) under ``model`` and a scalar
``score`` head, the layout transformers' own sequence classifiers have, so the engine reads it the same
way (``token_values`` calls the backbone and the head) and it saves and loads with ``save_pretrained``
/ ``from_pretrained`` (its ``config.json`` keeps the architecture's ``model_type`` and names
``ScoreHeadModel`` in ``architectures``).

This module imports transformers at import time; :mod:`rlhf_trainers.models` imports it only when needed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutputWithPast

SCORE_HEAD_ARCHITECTURE = "ScoreHeadModel"


def has_sequence_classification_class(config: PretrainedConfig) -> bool:
    """Whether ``AutoModelForSequenceClassification`` has a class for ``config``'s architecture."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING

    auto_map = getattr(config, "auto_map", None) or {}
    return type(config) in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING or (
        "AutoModelForSequenceClassification" in auto_map
    )


class ScoreHeadModel(PreTrainedModel):
    """``AutoModel.from_config(config)`` as ``model`` plus ``score = nn.Linear(hidden_size, 1, bias=False)``.

    ``forward`` returns the score read at the last token that is not ``config.pad_token_id`` (as
    transformers' sequence classifiers do); the on-policy engine reads per-token scores by applying
    ``score`` to the backbone's hidden states itself.
    """

    config_class = PretrainedConfig
    base_model_prefix = "model"
    # The backbone declares (and checks) its own attention support; the wrapper only forwards to it.
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def __init__(self, config: PretrainedConfig) -> None:
        config.num_labels = 1
        super().__init__(config)
        self.model = AutoModel.from_config(config)
        self.score = nn.Linear(config.hidden_size, 1, bias=False)
        self._no_split_modules = getattr(self.model, "_no_split_modules", None)
        self.post_init()

    @classmethod
    def from_pretrained(cls, path: Any, *args: Any, **kwargs: Any) -> ScoreHeadModel:
        """Load a folder saved by ``save_pretrained`` (its own config class is read from ``config.json``)."""
        if "config" not in kwargs:
            trust = {k: v for k, v in kwargs.items() if k == "trust_remote_code"}
            kwargs["config"] = AutoConfig.from_pretrained(path, **trust)
        return super().from_pretrained(path, *args, **kwargs)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.set_input_embeddings(value)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> SequenceClassifierOutputWithPast:
        kwargs.pop("labels", None)
        kwargs.setdefault("use_cache", False)
        hidden = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            **kwargs,
        ).last_hidden_state
        logits = self.score(hidden)
        rows = torch.arange(logits.shape[0], device=logits.device)
        pad = self.config.pad_token_id
        if input_ids is None or pad is None:
            last = torch.full_like(rows, logits.shape[1] - 1)
        else:
            # The rightmost non-pad token whatever the padding side.
            columns = torch.arange(input_ids.shape[1], device=input_ids.device)
            last = torch.where(input_ids != pad, columns, -1).max(-1).values.clamp(min=0)
        return SequenceClassifierOutputWithPast(logits=logits[rows, last.to(logits.device)])


def score_head_model_from_backbone(backbone: nn.Module, config: PretrainedConfig) -> ScoreHeadModel:
    """A :class:`ScoreHeadModel` whose ``model`` is ``backbone`` itself (no copy) and a new head."""
    with torch.device("meta"):
        scorer = ScoreHeadModel(config)
    scorer.model = backbone
    weight = backbone.get_input_embeddings().weight
    scorer.score = nn.Linear(config.hidden_size, 1, bias=False, device=weight.device, dtype=weight.dtype)
    return scorer
