"""Generation behind one interface.

A backend (:class:`GenerationBackend`) samples completions of left-padded prompts with given settings
(:class:`SamplingSettings`) and returns :class:`Samples`: tokens padded to ``max_new_tokens`` and, when
asked, each token's log-prob and each step's entropy. Two backends exist: the builtin loop
(:class:`BuiltinSampling`) and ``transformers``' ``generate()`` (:class:`TransformersGenerate`). The
on-policy trainers choose one once, at construction (:func:`make_generation_backend`), and print its
name in the batch accounting. Sampling from a policy outside a trainer (reward normalization, the demo's
preference labelling) goes through the same interface, in one place: :func:`sample_completions` and
:func:`sample_responses` (:mod:`.standalone`). See docs/generation.md.
"""

from __future__ import annotations

from .base import (
    DecodingSpeedups,
    GenerationBackend,
    GenerationError,
    Samples,
    SamplingSettings,
    check_samples,
)
from .builtin import (
    BuiltinSampling,
    Draw,
    FastDecodingSteps,
    FastStepsProvider,
    draw_inverse_cdf,
    draw_multinomial,
    sample_with_kv_cache,
    shared_prompt_rows,
)
from .factory import GENERATION_LOOPS, make_generation_backend
from .standalone import render_prompts, sample_completions, sample_responses
from .transformers_generate import TransformersGenerate, generation_config_set_aside

__all__ = [
    "GENERATION_LOOPS",
    "BuiltinSampling",
    "DecodingSpeedups",
    "Draw",
    "FastDecodingSteps",
    "FastStepsProvider",
    "GenerationBackend",
    "GenerationError",
    "Samples",
    "SamplingSettings",
    "TransformersGenerate",
    "check_samples",
    "draw_inverse_cdf",
    "draw_multinomial",
    "generation_config_set_aside",
    "make_generation_backend",
    "render_prompts",
    "sample_completions",
    "sample_responses",
    "sample_with_kv_cache",
    "shared_prompt_rows",
]
