"""PEFT is an optional dependency (the ``peft`` extra): asking for an adapter without it installed fails at
construction with an error that says how to install it; everything else never needs it."""

from __future__ import annotations

import sys

import pytest

from rlhf_trainers.models import _is_peft_model, require_peft
from tests.test_rloo import _trainer


@pytest.fixture
def no_peft(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` now raises ImportError


def test_require_peft_names_the_extra(no_peft):
    with pytest.raises(ImportError, match=r"peft_config needs PEFT.*rlhf_trainers\[peft\]"):
        require_peft("peft_config")


def test_a_trainer_with_peft_config_fails_at_construction_without_peft(no_peft, kit, tmp_path):
    with pytest.raises(ImportError, match=r"pip install 'rlhf_trainers\[peft\]'"):
        _trainer(kit, tmp_path, peft_config=object())


def test_a_trainer_without_adapters_needs_no_peft(no_peft, kit, tmp_path):
    trainer = _trainer(kit, tmp_path)
    assert not _is_peft_model(trainer.policy)
    trainer.train()
    assert trainer.state.global_step == 2
