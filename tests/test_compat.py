"""One test per private ``transformers.Trainer`` / ``accelerate`` API that rlhf_trainers/compat.py uses.

Each test fails when a transformers or accelerate release changes the hook: the private method is gone,
takes other parameters than the ones we pass, or ``Trainer`` no longer calls the one we override. They run
a real ``Trainer`` on a two-parameter toy model (a few hundred milliseconds).
"""

from __future__ import annotations

import inspect
import os
import re
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import GradientState
from torch import nn
from transformers import Trainer, TrainingArguments

from rlhf_trainers import compat
from rlhf_trainers.compat import EvaluateBeforeTrainMixin, TrainerHooksMixin
from rlhf_trainers.reliability import STAGING_PREFIX, AtomicCheckpointMixin


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        prediction = self.linear(x)
        return {"loss": ((prediction - y) ** 2).mean(), "logits": prediction}


def _dataset(rows: int = 8) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        {"x": torch.randn(4, generator=generator), "y": torch.randn(1, generator=generator)}
        for _ in range(rows)
    ]


def _args(tmp_path: Any, **overrides: Any) -> TrainingArguments:
    fields = {
        "output_dir": str(tmp_path),
        "use_cpu": True,
        "per_device_train_batch_size": 2,
        "per_device_eval_batch_size": 4,
        "max_steps": 2,
        "save_steps": 1,
        "logging_steps": 1,
        "max_grad_norm": 1.0,
        "report_to": [],
        "disable_tqdm": True,
        "label_names": ["y"],
    }
    fields.update(overrides)
    return TrainingArguments(**fields)


class RecordingTrainer(TrainerHooksMixin, Trainer):
    """Records which of our public methods the private hooks reached."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    def write_model(self, output_dir: str, state_dict: dict[str, Any] | None = None) -> None:
        self.calls.append("write_model")
        super().write_model(output_dir, state_dict)

    def load_weights_from_checkpoint(self, checkpoint: str, model: nn.Module | None = None) -> None:
        self.calls.append("load_weights_from_checkpoint")
        super().load_weights_from_checkpoint(checkpoint, model)

    def checkpoint_run_dir(self, trial: Any) -> str:
        self.calls.append("checkpoint_run_dir")
        return super().checkpoint_run_dir(trial)

    def write_checkpoint(self, model: nn.Module, trial: Any) -> None:
        self.calls.append("write_checkpoint")
        super().write_checkpoint(model, trial)


@pytest.fixture
def private_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the private ``Trainer``/accelerate methods called while the test runs."""
    calls: list[str] = []
    for owner, name in [
        (Trainer, "_init_training_state"),
        (Trainer, "_prepare_for_training"),
        (Trainer, "_load_rng_state"),
        (Trainer, "_get_learning_rate"),
        (Trainer, "_clip_grad_norm"),
        (Trainer, "_prepare_inputs"),
        (Trainer, "evaluation_loop"),
        (GradientState, "_set_sync_gradients"),
    ]:
        original = getattr(owner, name)

        def recorder(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, recorder)
    return calls


# ---- the parameters we pass ---------------------------------------------------------------------------------

# (owner, private method, the parameters compat.py passes, by position, after self)
SIGNATURES = [
    (
        Trainer,
        "_init_training_state",
        ["max_steps", "num_update_steps_per_epoch", "num_train_epochs", "resume_from_checkpoint", "trial"],
    ),
    (Trainer, "_prepare_for_training", ["max_steps", "train_dataloader", "resume_from_checkpoint"]),
    (Trainer, "_load_rng_state", ["checkpoint"]),
    (Trainer, "_save_checkpoint", ["model", "trial"]),
    (Trainer, "_get_learning_rate", []),
    (Trainer, "_clip_grad_norm", ["model"]),
    (Trainer, "_prepare_inputs", ["inputs"]),
    (Trainer, "_load_from_checkpoint", ["resume_from_checkpoint", "model"]),
    (Trainer, "_save", ["output_dir", "state_dict"]),
    (Trainer, "_get_output_dir", ["trial"]),
    (GradientState, "_set_sync_gradients", ["sync_gradients"]),
]


@pytest.mark.parametrize(("owner", "name", "parameters"), SIGNATURES, ids=[s[1] for s in SIGNATURES])
def test_private_method_takes_the_parameters_we_pass(owner: type, name: str, parameters: list[str]) -> None:
    method = getattr(owner, name, None)
    assert method is not None, (
        f"{owner.__name__}.{name} is gone; rlhf_trainers/compat.py calls or overrides it"
    )
    assert list(inspect.signature(method).parameters)[1:] == parameters


def test_overrides_take_the_same_parameters_as_the_hooks_they_replace() -> None:
    for name in ("_save", "_load_from_checkpoint", "_get_output_dir", "_save_checkpoint"):
        ours = list(inspect.signature(getattr(TrainerHooksMixin, name)).parameters)
        assert ours == list(inspect.signature(getattr(Trainer, name)).parameters), name
    ours = inspect.signature(EvaluateBeforeTrainMixin.evaluation_loop).parameters
    assert "args" in ours and "kwargs" in ours  # forwards whatever Trainer.evaluate passes


# ---- Trainer still calls the hooks ----------------------------------------------------------------------------


def test_train_save_and_resume_go_through_every_hook(tmp_path: Any, private_calls: list[str]) -> None:
    trainer = RecordingTrainer(model=ToyModel(), args=_args(tmp_path), train_dataset=_dataset())
    trainer.train()
    assert {"write_checkpoint", "checkpoint_run_dir", "write_model"} <= set(trainer.calls)
    assert {"_init_training_state", "_prepare_for_training", "_get_learning_rate", "_clip_grad_norm"} <= set(
        private_calls
    )
    assert os.path.isfile(tmp_path / "checkpoint-2" / "model.safetensors")

    trainer.calls.clear()
    trainer.save_model(str(tmp_path / "final"))
    assert trainer.calls == ["write_model"]

    private_calls.clear()
    resumed = RecordingTrainer(model=ToyModel(), args=_args(tmp_path, max_steps=3), train_dataset=_dataset())
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert "load_weights_from_checkpoint" in resumed.calls
    assert "_load_rng_state" in private_calls
    assert resumed.state.global_step == 3


def test_evaluate_reaches_evaluation_loop_and_prepare_inputs(tmp_path: Any, private_calls: list[str]) -> None:
    trainer = RecordingTrainer(model=ToyModel(), args=_args(tmp_path), eval_dataset=_dataset(4))
    metrics = trainer.evaluate()
    assert "eval_loss" in metrics
    assert {"evaluation_loop", "_prepare_inputs"} <= set(private_calls)


# ---- the calls, with the arguments the on-policy engine passes -----------------------------------------------


class AtomicTrainer(AtomicCheckpointMixin, Trainer):
    pass


def test_calls_in_the_order_the_on_policy_engine_makes_them(tmp_path: Any) -> None:
    trainer = AtomicTrainer(model=ToyModel(), args=_args(tmp_path), train_dataset=_dataset())
    assert compat.init_training_state(trainer, 2, 1, 2, None, None) == (0, 0)
    assert trainer.state.max_steps == 2
    model, dataloader = compat.prepare_for_training(trainer, 2, None, None)
    assert dataloader is None and trainer.optimizer is not None and trainer.lr_scheduler is not None
    assert compat.get_learning_rate(trainer) == pytest.approx(trainer.args.learning_rate)

    batch = compat.prepare_inputs(trainer, {"x": torch.full((2, 4), 100.0), "y": torch.zeros(2, 1)})
    compat.set_sync_gradients(trainer.accelerator, False)
    assert trainer.accelerator.sync_gradients is False
    compat.set_sync_gradients(trainer.accelerator, True)
    assert trainer.accelerator.sync_gradients is True
    trainer.accelerator.backward(model(**batch)["loss"])
    norm = float(compat.clip_grad_norm(trainer, model))
    assert norm > 1.0  # the norm before clipping ...
    clipped = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    assert float(clipped) == pytest.approx(1.0, rel=1e-4)  # ... and the gradients clipped to max_grad_norm
    trainer.optimizer.step()
    trainer.state.global_step = 1

    rng_at_save = torch.random.get_rng_state()
    compat.save_checkpoint(trainer, model)  # through AtomicCheckpointMixin: staged, then renamed
    checkpoint = tmp_path / "checkpoint-1"
    assert os.path.isfile(checkpoint / "model.safetensors") and os.path.isfile(checkpoint / "rng_state.pth")
    assert not [entry for entry in os.listdir(tmp_path) if entry.startswith(STAGING_PREFIX)]

    saved = {name: value.clone() for name, value in trainer.model.state_dict().items()}
    with torch.no_grad():
        for parameter in trainer.model.parameters():
            parameter.zero_()
    compat.load_from_checkpoint(trainer, str(checkpoint))
    for name, value in trainer.model.state_dict().items():
        torch.testing.assert_close(value, saved[name])

    torch.rand(3)
    assert not torch.equal(torch.random.get_rng_state(), rng_at_save)
    compat.load_rng_state(trainer, str(checkpoint))
    assert torch.equal(torch.random.get_rng_state(), rng_at_save)


# ---- accelerate's preparation mark -----------------------------------------------------------------------------


def test_forget_evaluation_preparation_lets_prepare_wrap_the_model_again() -> None:
    accelerator = Accelerator(cpu=True)
    model = ToyModel()
    accelerator.prepare_model(model, evaluation_mode=True)
    assert compat.is_prepared(model)
    assert any(m is model for m in accelerator._models)
    compat.forget_evaluation_preparation(accelerator, model)
    assert not compat.is_prepared(model)
    assert not any(m is model for m in accelerator._models)
    accelerator.prepare_model(model)
    assert compat.is_prepared(model)


class EvaluateFirstTrainer(EvaluateBeforeTrainMixin, RecordingTrainer):
    pass


def test_evaluate_before_train_uses_the_trainer_attributes_the_fix_resets(tmp_path: Any) -> None:
    trainer = EvaluateFirstTrainer(
        model=ToyModel(), args=_args(tmp_path), train_dataset=_dataset(), eval_dataset=_dataset(4)
    )
    for attribute in ("deepspeed", "is_deepspeed_enabled", "is_fsdp_enabled", "model_wrapped", "accelerator"):
        assert hasattr(trainer, attribute), attribute
    assert trainer._deepspeed_config_snapshot is None  # no DeepSpeed here
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    assert after != before


# ---- hooks outside Trainer ---------------------------------------------------------------------------------


def test_zero3_offload_still_has_the_method_that_registers_its_hooks() -> None:
    offload_module = pytest.importorskip("deepspeed.runtime.zero.parameter_offload")
    method = offload_module.DeepSpeedZeRoOffload._register_deepspeed_module
    assert list(inspect.signature(method).parameters)[1] == "module"
    registered: list[nn.Module] = []

    class Offload:
        module = ToyModel()

        def _register_deepspeed_module(self, module: nn.Module) -> None:
            registered.append(module)

    offload = Offload()
    compat.register_zero3_hooks(offload)
    assert registered == [offload.module]


def test_accelerate_keeps_the_deepspeed_engine_where_compat_looks() -> None:
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper

    # prepare() under DeepSpeed keeps the training engine there (the attribute exists under DeepSpeed only)
    assert "self.deepspeed_engine_wrapped = DeepSpeedEngineWrapper(engine)" in inspect.getsource(
        Accelerator._prepare_deepspeed
    )
    accelerator = Accelerator(cpu=True)
    assert compat.deepspeed_training_engine(accelerator) is None
    engine = object()
    accelerator.deepspeed_engine_wrapped = DeepSpeedEngineWrapper(engine)
    assert compat.deepspeed_training_engine(accelerator) is engine


def test_zero_optimizers_still_report_skipped_steps_where_the_guard_looks() -> None:
    stage2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    # the flags the ZeRO-1/2 optimizer takes, and the overflow flag both ZeRO optimizers set in step()
    parameters = inspect.signature(stage2.DeepSpeedZeroOptimizer.__init__).parameters
    assert "check_grad_overflow" in parameters and "compute_grad_norm" in parameters
    for optimizer in (stage2.DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3):
        assert "self.overflow = True" in inspect.getsource(optimizer), optimizer.__name__
    # what the engine exposes of a step
    for name in ("was_step_applied", "fp16_enabled"):
        assert callable(getattr(DeepSpeedEngine, name))
    assert "self.global_steps += 1" in inspect.getsource(DeepSpeedEngine._take_model_step)

    class Zero12:
        overflow = False
        compute_grad_norm = False
        check_grad_overflow = False

    optimizer = Zero12()
    assert compat.zero_optimizer_skips_nonfinite_steps(optimizer) and optimizer.check_grad_overflow
    # bf16 without its overflow check: the norm does not decide there, the scan is turned on
    bf16 = Zero12()
    bf16.compute_grad_norm, bf16.dtype = True, torch.bfloat16
    assert compat.zero_optimizer_skips_nonfinite_steps(bf16) and bf16.check_grad_overflow
    # fp32 with its norm: left as it is
    fp32 = Zero12()
    fp32.compute_grad_norm, fp32.dtype = True, torch.float32
    assert compat.zero_optimizer_skips_nonfinite_steps(fp32) and not fp32.check_grad_overflow
    # (the condition under which ZeRO-1/2's norm decides, whitespace aside)
    step_source = " ".join(inspect.getsource(stage2.DeepSpeedZeroOptimizer.step).split())
    assert (
        "(self.dtype != torch.bfloat16 or self.check_grad_overflow) and is_invalid_grad_norm" in step_source
    )
    assert not compat.zero_optimizer_skips_nonfinite_steps(torch.optim.SGD([nn.Parameter(torch.ones(1))]))


def test_transformers_marks_a_model_with_a_loaded_adapter_where_compat_looks() -> None:
    from transformers.integrations.peft import PeftAdapterMixin

    assert PeftAdapterMixin._hf_peft_config_loaded is False
    for method in (PeftAdapterMixin.load_adapter, PeftAdapterMixin.add_adapter):
        assert "self._hf_peft_config_loaded = True" in inspect.getsource(method), method.__name__
    model = ToyModel()
    assert not compat.has_loaded_adapter(model)
    model._hf_peft_config_loaded = True
    assert compat.has_loaded_adapter(model)


# ---- our trainers use only the public names ------------------------------------------------------------------


def test_our_trainers_override_the_public_methods_not_trainers_private_hooks() -> None:
    from rlhf_trainers import PPOTrainer, RewardTrainer, RLOOTrainer
    from rlhf_trainers.onpolicy.trainer import OnPolicyTrainer

    for trainer_class in (OnPolicyTrainer, PPOTrainer, RLOOTrainer, RewardTrainer):
        for hook in ("_save", "_load_from_checkpoint", "_get_output_dir", "_save_checkpoint"):
            assert getattr(trainer_class, hook) is getattr(TrainerHooksMixin, hook), (trainer_class, hook)
    engine_writes = OnPolicyTrainer.write_model
    assert engine_writes is not TrainerHooksMixin.write_model  # the engine writes policy + value model
    assert (
        OnPolicyTrainer.write_extra_checkpoint_state is not AtomicCheckpointMixin.write_extra_checkpoint_state
    )


def _private_names_of(*owners: type) -> set[str]:
    names = set()
    for owner in owners:
        names |= {n for n in dir(owner) if n.startswith("_") and not n.startswith("__")}
        try:
            names |= set(re.findall(r"self\.(_[a-z][a-z0-9_]*)", inspect.getsource(owner)))
        except (OSError, TypeError):
            pass
    return names


def test_no_module_but_compat_touches_a_private_name_of_trainer_or_accelerate() -> None:
    from accelerate.state import AcceleratorState

    private = _private_names_of(Trainer, TrainingArguments, Accelerator, AcceleratorState, GradientState)
    private -= _private_names_of(nn.Module, object)  # torch's and Python's own
    package = os.path.dirname(compat.__file__)
    found = []
    for folder, _, files in os.walk(package):
        for file in files:
            path = os.path.join(folder, file)
            if not file.endswith(".py") or os.path.samefile(path, compat.__file__):
                continue
            with open(path) as handle:
                for number, line in enumerate(handle, 1):
                    found += [
                        f"{os.path.relpath(path, package)}:{number}: {name}"
                        for name in re.findall(r"\.(_[a-z][a-z0-9_]*)\b", line)
                        if name in private
                    ]
    assert not found, "private Trainer/accelerate names outside compat.py:\n" + "\n".join(found)


def test_the_kv_cache_by_the_name_the_model_has():
    """The new name (``cache``) where the output class and the forward have it; ``past_key_values`` for a
    model written for a transformers release before the rename (here a stand-in)."""
    from dataclasses import dataclass

    from rlhf_trainers.testing import get_kit

    model = get_kit().load_model("llama")
    out = model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True)
    assert compat.cache_keyword(model) == "cache"
    assert compat.output_cache(out) is out.cache is not None

    @dataclass
    class OldOutput:
        logits: Any = None
        past_key_values: Any = None

    class OldModel(nn.Module):
        def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=None):
            return OldOutput(input_ids.float(), ("keys", "values"))

    old = OldModel()
    assert compat.cache_keyword(old) == "past_key_values"
    assert compat.output_cache(old(torch.tensor([[1]]))) == ("keys", "values")


def test_activation_checkpointing_by_the_name_the_model_has():
    from rlhf_trainers.testing import get_kit

    model = get_kit().load_model("llama")
    compat.enable_activation_checkpointing(model, {"use_reentrant": False})
    assert any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())

    calls = []

    class OldModel(nn.Module):
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            calls.append(gradient_checkpointing_kwargs)

    compat.enable_activation_checkpointing(OldModel(), {"use_reentrant": False})
    assert calls == [{"use_reentrant": False}]
