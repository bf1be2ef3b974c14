"""Every field of the trainers' configs and of CPUOptions documents itself in a few lines of ``--help``: at
most ~60 words, no machine names and no benchmark figures (those live in docs/benchmarks.md and
docs/cpu.md, with their machine and date)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from rlhf_trainers import CPUOptions, GRPOConfig, OnPolicyConfig, PPOConfig, RewardConfig, RLOOConfig

MAX_WORDS = 60

#: Machine and processor names, and a session's narrative.
MACHINES = re.compile(
    r"\b(Xeon|EPYC|Epyc|AMD|Intel|Ryzen|Zen ?\d|Graviton|Apple M\d|[AHBLV]100|H200|A10G?|L4|T4|RTX ?\d+|"
    r"session|issue #\d+)\b"
)
#: A measured figure: a time (``9.3 s``, ``23 ms``) or a before -> after pair.
FIGURES = re.compile(r"\d(\.\d+)?\s?(ms|s)\b|\d\s*->\s*\d")


def _our_fields(cls: type) -> list[dataclasses.Field]:
    """The fields that ``cls`` or one of this package's classes in its MRO declares (those of
    ``TrainingArguments`` that no class of ours re-declares are transformers' own)."""
    ours = set()
    for klass in cls.__mro__:
        if klass.__module__.startswith("rlhf_trainers."):
            ours.update(vars(klass).get("__annotations__", {}))
    return [f for f in dataclasses.fields(cls) if f.name in ours]


CONFIGS = [OnPolicyConfig, PPOConfig, RLOOConfig, GRPOConfig, RewardConfig, CPUOptions]


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_field_has_a_short_help_without_machines_or_figures(cls):
    problems = []
    for f in _our_fields(cls):
        text = f.metadata.get("help", "")
        words = len(text.split())
        if not text:
            problems.append(f"{f.name}: no help")
        if words > MAX_WORDS:
            problems.append(f"{f.name}: {words} words (at most {MAX_WORDS})")
        for pattern in (MACHINES, FIGURES):
            found = pattern.search(text)
            if found:
                problems.append(f"{f.name}: names {found.group(0)!r} (measurements belong in docs/)")
    assert not problems, "\n".join(problems)


def test_the_walk_covers_the_configs_fields():
    names = {f.name for f in _our_fields(PPOConfig)}
    assert {"kl_coef", "rollout_values", "save_on_interrupt", "logging_steps"} <= names
    assert "dataloader_multiprocessing_context" not in names  # transformers' own, not re-declared
    assert {f.name for f in _our_fields(CPUOptions)} == {f.name for f in dataclasses.fields(CPUOptions)}


def test_the_algorithm_configs_carry_no_cpu_switch():
    switches = {f.name for f in dataclasses.fields(CPUOptions)}
    for cls in CONFIGS[:-1]:
        assert not switches & {f.name for f in dataclasses.fields(cls)}, cls.__name__


def test_the_checks_catch_what_they_are_for():
    assert MACHINES.search("measured on the 2-core Intel Xeon")
    assert MACHINES.search("on an AMD EPYC") and MACHINES.search("an H100")
    assert FIGURES.search("10.8 -> 9.3 s") and FIGURES.search("took 23 ms")
    assert not MACHINES.search("vendor_id GenuineIntel") and not FIGURES.search("about 1e-6, 0: any size")
