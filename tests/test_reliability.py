"""Reliability of the three trainers (issue #8): interruption and resume, atomic checkpoints, non-finite
steps, failing reward functions.

The kill and signal tests run the trainers in subprocesses (tests/scripts/reliability_run.py): a
process that SIGKILLs itself while writing a checkpoint, or sends itself SIGTERM in the middle of an
update, and a second process that resumes. The resumed run must log the same metrics as an
uninterrupted run with the same seed. Interruption under DeepSpeed ZeRO-2 is tested in
tests/test_ppo_distributed.py, which already trains the uninterrupted ZeRO-2 run to compare with.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import signal
import subprocess
from pathlib import Path

import file_syncs  # tests/ is on sys.path under pytest
import forked
import pytest
import torch
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from rlhf_trainers import PPOConfig, PPOTrainer, RewardConfig, RewardTrainer, reliability
from rlhf_trainers.reliability import STAGING_PREFIX
from rlhf_trainers.testing import true_reward

SCRIPT = Path(__file__).parent / "scripts" / "reliability_run.py"
#: Logged values that measure time, not training, and Trainer's end-of-run summary: its train_loss divides
#: the losses seen since the (re)start by all steps, so it is not comparable across a resume.
TIME_KEYS = (
    "timing/",
    "perf/",
    "train_runtime",
    "train_samples_per_second",
    "train_steps_per_second",
    "train_loss",
)


def _run(kind: str, out: Path, mode: str, step: int | None = None, *how: str) -> subprocess.CompletedProcess:
    """The script as a fresh process runs it (a fork of a server with the imports done: tests/forked.py)."""
    args = [kind, str(out), mode] + ([str(step)] if step else []) + list(how)
    return forked.run(SCRIPT, args, timeout=600)


def _history(out: Path) -> dict[int, dict[str, float]]:
    """Per step, the merged numeric training log entries (not time measurements)."""
    merged: dict[int, dict[str, float]] = {}
    for entry in json.loads((out / "log_history.json").read_text()):
        values = {
            k: v
            for k, v in entry.items()
            if isinstance(v, (int, float)) and k not in ("step", "epoch") and not k.startswith(TIME_KEYS)
        }
        merged.setdefault(entry["step"], {}).update(values)
    return merged


def _assert_same_steps(full: Path, resumed: Path, steps: list[int]) -> None:
    a, b = _history(full), _history(resumed)
    for step in steps:
        assert step in a and step in b, (step, sorted(a), sorted(b))
        keys = sorted(set(a[step]) & set(b[step]))
        assert any(k.startswith(("loss", "objective/")) for k in keys), keys
        for key in keys:
            assert a[step][key] == pytest.approx(b[step][key], rel=1e-5, abs=1e-7), (step, key)


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


#: Per trainer, a second interruption besides SIGTERM mid-update: (phase, signal, update it arrives in,
#: the update after which training stops). A signal while checkpoint-2 is written lets that save finish;
#: it is acted on at the end of the next update, which then writes its own checkpoint.
OTHER_INTERRUPTION = {
    "ppo": ("rollout", "INT", 3, 3),
    "ppo-agent": ("rollout", "INT", 3, 3),  # PPO with tools, on the kit agent: real multi-turn episodes
    "rloo": ("save", "TERM", 2, 3),
    "reward": ("save", "INT", 2, 3),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ppo", "rloo", "reward", "ppo-agent"])
def test_sigkill_while_saving_and_sigterm_mid_update_resume_like_an_uninterrupted_run(kind, tmp_path):
    full = tmp_path / "full"
    _ok(_run(kind, full, "full"))

    # SIGKILL while checkpoint-4 is being written: the newest complete checkpoint is checkpoint-2.
    killed = tmp_path / "killed"
    proc = _run(kind, killed, "kill-in-save", 4)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert (killed / f"{STAGING_PREFIX}checkpoint-4").is_dir()  # the partial write is there...
    assert not (killed / "checkpoint-4").exists()  # ...but never under a name resume would pick
    assert get_last_checkpoint(str(killed)) == str(killed / "checkpoint-2")
    _ok(_run(kind, killed, "resume"))
    _assert_same_steps(full, killed, [3, 4])
    assert not (killed / f"{STAGING_PREFIX}checkpoint-4").exists()  # the re-save cleaned it up

    # SIGTERM in the middle of update 3: train() finishes it, saves checkpoint-3 and returns cleanly.
    stopped = tmp_path / "stopped"
    proc = _run(kind, stopped, "signal", 3)
    _ok(proc)
    result = json.loads((stopped / "result-rank0.json").read_text())
    assert result == {"rank": 0, "global_step": 3, "interrupted": True, "world_size": 1, "error": None}
    assert "SIGTERM received" in proc.stderr
    assert (stopped / "checkpoint-3" / "trainer_state.json").is_file()
    _assert_same_steps(full, stopped, [3])

    # SIGINT (Ctrl-C) during a rollout, or a signal while a checkpoint is being written: the same clean
    # stop after the update, a complete checkpoint of it, and a resume that logs what the full run did.
    phase, signame, at, stops_after = OTHER_INTERRUPTION[kind]
    other = tmp_path / f"{phase}-{signame}"
    proc = _run(kind, other, "signal", at, phase, signame)
    _ok(proc)
    result = json.loads((other / "result-rank0.json").read_text())
    assert (result["global_step"], result["interrupted"]) == (stops_after, True)
    assert f"SIG{signame} received" in proc.stderr
    assert get_last_checkpoint(str(other)) == str(other / f"checkpoint-{stops_after}")
    assert not list(other.glob(f"{STAGING_PREFIX}*"))
    _ok(_run(kind, other, "resume"))
    _assert_same_steps(full, other, [stops_after, 4])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """Under DDP (2 CPU ranks) only rank 1 gets SIGTERM, in the middle of update 3: the ranks combine
    their flags, both finish update 3, write one checkpoint-3 together and return; a 2-rank resume
    finishes the run."""
    from distributed import read_rank_results, run_script

    out = tmp_path / "ddp"
    run_script(SCRIPT, ["ppo", str(out), "signal", "3"], num_processes=2, timeout=600)
    results = read_rank_results(out)
    assert [(r["global_step"], r["interrupted"]) for r in results] == [(3, True), (3, True)]
    assert (out / "checkpoint-3" / "trainer_state.json").is_file()
    assert not [p for p in out.iterdir() if p.name.startswith(STAGING_PREFIX)]
    run_script(SCRIPT, ["ppo", str(out), "resume"], num_processes=2, timeout=600)
    results = read_rank_results(out)
    assert [(r["global_step"], r["interrupted"]) for r in results] == [(4, False), (4, False)]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_generation_failure_on_one_rank_stops_every_rank_with_a_checkpoint(tmp_path):
    """Under DDP (2 CPU ranks) rank 1's generation backend fails from update 3 on (its vLLM engine died):
    both ranks stop in that generation, together (rank 0 is not left waiting in a collective), write
    checkpoint-2 together and raise GenerationError naming it (rank 1 with its cause, rank 0 naming the
    failed rank); a 2-rank resume from it finishes the run."""
    from distributed import read_rank_results, run_script

    out = tmp_path / "ddp"
    run_script(SCRIPT, ["rloo", str(out), "generation-failure", "3"], num_processes=2, timeout=300)
    first, last = read_rank_results(out)
    assert (first["global_step"], last["global_step"]) == (2, 2)
    assert re.search(r"(?s)^GenerationError: the engine died.*step 2.*checkpoint-2", last["error"])
    assert re.search(
        r"(?s)^GenerationError: Generation failed on process\(es\) \[1\].*checkpoint-2", first["error"]
    )
    assert (out / "checkpoint-2" / "trainer_state.json").is_file()
    run_script(SCRIPT, ["rloo", str(out), "resume"], num_processes=2, timeout=300)
    results = read_rank_results(out)
    assert [(r["global_step"], r["error"]) for r in results] == [(4, None), (4, None)]


# ---- in-process tests ---------------------------------------------------------------------------------


def _ppo(kit, tmp_path, callbacks=None, reward_funcs=true_reward, **overrides) -> PPOTrainer:
    fields = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 8,
        "num_mini_batches": 1,
        "num_ppo_epochs": 1,
        "response_length": 8,
        "learning_rate": 1e-3,
        "max_steps": 3,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "seed": 0,
        "num_sample_generations": 0,
        "disable_tqdm": True,
        "logging_steps": 1,
    }
    fields.update(overrides)
    return PPOTrainer(
        model=kit.load_model("llama-sft"),
        processing_class=kit.load_tokenizer(),
        args=PPOConfig(**fields),
        train_dataset=kit.prompt_dataset("train", n=32),
        reward_funcs=reward_funcs,
        callbacks=callbacks,
    )


def _digest(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in module.parameters()]).clone()


class Snapshots(TrainerCallback):
    """The policy's weights after every step."""

    def __init__(self) -> None:
        self.trainer = None
        self.after: dict[int, torch.Tensor] = {}

    def on_step_end(self, args, state, control, **kwargs):
        self.after[state.global_step] = _digest(self.trainer.policy)


def _poison_training_logits(trainer, when) -> None:
    """NaN logits in training forward passes (not in the rollout, which runs without gradients)."""

    def hook(module, inputs, output):
        if torch.is_grad_enabled() and when(trainer.state.global_step):
            return output * math.nan
        return output

    trainer.policy.lm_head.register_forward_hook(hook)


def test_a_step_with_nan_gradients_is_skipped_and_counted(kit, tmp_path):
    snapshots = Snapshots()
    trainer = _ppo(kit, tmp_path, callbacks=[snapshots])
    snapshots.trainer = trainer
    _poison_training_logits(trainer, lambda finished: finished == 1)  # update 2 only
    trainer.train()
    assert not torch.equal(snapshots.after[1], snapshots.after[3])
    assert torch.equal(snapshots.after[1], snapshots.after[2])  # the skipped step changed nothing
    assert (
        torch.isfinite(_digest(trainer.policy)).all() and torch.isfinite(_digest(trainer.value_model)).all()
    )
    logs = {h["step"]: h for h in trainer.state.log_history if "train/nonfinite_steps_skipped" in h}
    assert [logs[s]["train/nonfinite_steps_skipped"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]


class SigtermAfter(TrainerCallback):
    """Send this process SIGTERM at the end of update ``step`` (``save_on_interrupt`` then saves and stops)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_resume_inside_a_logging_window_logs_the_uninterrupted_runs_entries(kit, tmp_path):
    """A log entry averages the updates since the previous one (logging_steps=4 here); an interruption
    can save between two entries. The resumed run logs at step 8 the average over updates 5-8, as the
    uninterrupted run does (the updates before the interruption included), and counts the skipped
    non-finite step of update 2 (train/nonfinite_steps_skipped) as it does."""
    settings = {"max_steps": 8, "logging_steps": 4, "seed": 5}
    full = _ppo(kit, tmp_path / "full", **settings)
    _poison_training_logits(full, lambda finished: finished == 1)
    full.train()
    stopped = _ppo(kit, tmp_path / "run", callbacks=[SigtermAfter(6)], **settings)
    _poison_training_logits(stopped, lambda finished: finished == 1)
    stopped.train()
    assert stopped.interrupted and stopped.state.global_step == 6
    resumed = _ppo(kit, tmp_path / "run", **settings)
    resumed.train(resume_from_checkpoint=True)

    def entries(trainer):
        return {h["step"]: h for h in trainer.state.log_history if "objective/scores" in h}

    a, b = entries(full), entries(resumed)
    assert sorted(a) == [4, 8] and sorted(b) == [4, 8]  # the resumed state holds the entry of step 4
    assert a[8]["train/nonfinite_steps_skipped"] == 1.0
    for key, value in a[8].items():
        if isinstance(value, (int, float)) and not key.startswith(TIME_KEYS):
            assert b[8][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (key, value, b[8][key])


def test_too_many_consecutive_nonfinite_steps_stop_training_with_the_causes(kit, tmp_path):
    trainer = _ppo(kit, tmp_path, max_steps=5, max_nonfinite_steps=2)
    _poison_training_logits(trainer, lambda finished: True)
    with pytest.raises(
        FloatingPointError, match=r"3 consecutive optimizer steps.*max_nonfinite_steps=2.*learning rate"
    ):
        trainer.train()
    assert trainer.state.global_step == 2  # two steps skipped, the third stopped training
    assert torch.isfinite(_digest(trainer.policy)).all()


def test_reward_trainer_skips_a_nonfinite_step(kit, tmp_path):
    trainer = RewardTrainer(
        model=str(kit.model_path("llama-sft")),
        args=RewardConfig(
            output_dir=str(tmp_path / "rm"),
            per_device_train_batch_size=8,
            max_steps=3,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            max_length=64,
            disable_tqdm=True,
        ),
        train_dataset=kit.preference_dataset("train", n=32),
    )
    head = trainer.model.score

    def hook(module, inputs, output):
        return output * math.nan if torch.is_grad_enabled() and trainer.state.global_step == 1 else output

    head.register_forward_hook(hook)
    trainer.train()
    assert torch.isfinite(_digest(trainer.model)).all()
    skipped = [h["train/nonfinite_steps_skipped"] for h in trainer.state.log_history if "loss" in h]
    assert skipped[0] == 0.0 and skipped[-1] == 1.0


def test_a_failing_reward_function_names_the_function_and_the_prompt(kit, tmp_path):
    def picky(prompts, completions, **kwargs):
        return [1.0 / (len(p) != len(prompts[0]) or 0) for p in prompts]  # ZeroDivisionError on some rows

    trainer = _ppo(kit, tmp_path, reward_funcs=picky, max_steps=1)
    with pytest.raises(
        RuntimeError, match=r"reward function 'picky' raised ZeroDivisionError.*at prompt index \d+"
    ):
        trainer.train()


def test_skip_mode_leaves_a_failing_call_out_of_the_update_and_counts_it(kit, tmp_path):
    calls = []

    def flaky(prompts, completions, **kwargs):
        calls.append(len(prompts))
        if len(calls) == 2:
            raise ConnectionError("reward server timed out")
        if len(calls) == 3:
            return [0.0] * (len(prompts) - 1)  # one value short
        return true_reward(prompts, completions)

    trainer = _ppo(kit, tmp_path, reward_funcs=flaky, reward_func_errors="skip", max_steps=4)
    trainer.train()
    errors = [
        h["rollout/reward_func_errors"]
        for h in trainer.state.log_history
        if "rollout/reward_func_errors" in h
    ]
    assert errors == [0.0, 8.0, 8.0, 0.0]
    invalid = [
        h["rollout/invalid_rewards"] for h in trainer.state.log_history if "rollout/invalid_rewards" in h
    ]
    assert invalid == [0.0, 8.0, 8.0, 0.0]
    assert torch.isfinite(_digest(trainer.policy)).all()


def test_nan_inf_and_none_rewards_are_masked_and_counted(kit, tmp_path):
    def holes(prompts, completions, **kwargs):
        bad = [math.nan, math.inf, None, -math.inf]
        return [bad[i] if i < len(bad) else s for i, s in enumerate(true_reward(prompts, completions))]

    trainer = _ppo(kit, tmp_path, reward_funcs=holes, max_steps=2)
    trainer.train()
    invalid = [
        h["rollout/invalid_rewards"] for h in trainer.state.log_history if "rollout/invalid_rewards" in h
    ]
    assert invalid == [4.0, 4.0]
    for h in trainer.state.log_history:
        for key in ("objective/scores", "loss/policy_avg", "loss/value_avg"):
            if key in h:
                assert math.isfinite(h[key]), (key, h)
    assert (
        torch.isfinite(_digest(trainer.policy)).all() and torch.isfinite(_digest(trainer.value_model)).all()
    )


def test_checkpoints_appear_only_complete_and_rotation_waits_for_the_new_one(kit, tmp_path):
    out = tmp_path / "out"
    stale = out / f"{STAGING_PREFIX}checkpoint-2"
    stale.mkdir(parents=True)
    (stale / "half-written.bin").write_bytes(b"\0" * 10)
    trainer = _ppo(kit, tmp_path, max_steps=4, save_strategy="steps", save_steps=1, save_total_limit=2)
    seen: list[list[str]] = []

    class Watch(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            seen.append(sorted(os.listdir(out)))

    trainer.add_callback(Watch())
    trainer.train()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("checkpoint", "."))) == [
        "checkpoint-3",
        "checkpoint-4",
    ]
    for listing in seen:  # after every save: complete checkpoints only, never more than the limit
        assert not [n for n in listing if n.startswith(STAGING_PREFIX)], listing
        assert len([n for n in listing if n.startswith("checkpoint-")]) <= 2, listing
    assert (out / "checkpoint-4" / "trainer_state.json").is_file()


@pytest.mark.skipif(not file_syncs.can_record(), reason="needs /proc/self/fd to name fsync'ed files")
def test_every_file_and_folder_of_a_checkpoint_is_fsynced_before_the_rename(kit, tmp_path, monkeypatch):
    """Power loss: the checkpoint's files (weights, value model in a subfolder, optimizer, RNG, trainer and
    on-policy state) and folders are fsync'ed in staging, then renamed, then the rename is fsync'ed; so the
    rename cannot reach the disk before the bytes it makes look complete. Without the fsyncs the same
    record check fails (the check can fail)."""
    out = tmp_path / "out"
    with file_syncs.record_file_syncs() as events:
        trainer = _ppo(kit, tmp_path, max_steps=2, save_strategy="steps", save_steps=1, save_total_limit=1)
        trainer.train()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("checkpoint", "."))) == ["checkpoint-2"]
    checkpoint = out / "checkpoint-2"
    assert (checkpoint / "value_model" / "model.safetensors").is_file()
    assert file_syncs.not_durable_before_rename(events, checkpoint) == []
    replaced = [i for i, e in enumerate(events) if e[0] == "replace" and e[2].endswith("checkpoint-1")]
    assert len(replaced) == 1  # checkpoint-1 was made durable the same way before it was rotated away
    assert any(
        e[0] == "fsync" and e[1].endswith("checkpoint-1/trainer_state.json") for e in events[: replaced[0]]
    )

    # RewardTrainer saves through transformers.Trainer's own loop, into the same staging.
    reward = RewardTrainer(
        model=str(kit.model_path("llama-sft")),
        args=RewardConfig(
            output_dir=str(tmp_path / "rm"),
            per_device_train_batch_size=8,
            max_steps=1,
            save_strategy="steps",
            save_steps=1,
            report_to="none",
            use_cpu=True,
            max_length=64,
            disable_tqdm=True,
        ),
        train_dataset=kit.preference_dataset("train", n=8),
    )
    with file_syncs.record_file_syncs() as events:
        reward.train()
    assert file_syncs.not_durable_before_rename(events, tmp_path / "rm" / "checkpoint-1") == []

    monkeypatch.setattr(reliability, "FSYNC_CHECKPOINTS", False)
    with file_syncs.record_file_syncs() as events:
        _ppo(kit, tmp_path / "unsynced", max_steps=1, save_strategy="steps", save_steps=1).train()
    missing = file_syncs.not_durable_before_rename(events, tmp_path / "unsynced" / "out" / "checkpoint-1")
    assert "trainer_state.json not fsync'ed before the rename" in missing


@pytest.mark.skipif(not file_syncs.can_record(), reason="needs /proc/self/fd to name fsync'ed files")
def test_fsync_tree_syncs_every_file_and_folder_deepest_first(tmp_path, monkeypatch):
    (tmp_path / "a" / "b").mkdir(parents=True)
    for name in ("x.bin", "a/y.json", "a/b/z.pt"):
        (tmp_path / name).write_bytes(b"1")
    (tmp_path / "link").symlink_to(tmp_path / "x.bin")
    synced: list[str] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    assert reliability.fsync_tree(str(tmp_path)) == 6  # 3 files, 3 folders; the symlink is skipped
    root = os.path.realpath(tmp_path)
    expected = {os.path.join(root, p) for p in ("x.bin", "a/y.json", "a/b/z.pt", "a", "a/b")} | {root}
    assert set(synced) == expected and len(synced) == 6
    assert synced[-1] == root  # the top folder last, after everything in it
    assert synced.index(os.path.join(root, "a/b")) < synced.index(os.path.join(root, "a"))


@pytest.mark.parametrize(
    ("code", "raised"), [(errno.EINVAL, False), (errno.ENOTSUP, False), (errno.EIO, True)]
)
def test_fsync_tree_goes_on_where_fsync_is_unsupported_and_raises_a_write_error(
    tmp_path, monkeypatch, code, raised
):
    (tmp_path / "x.bin").write_bytes(b"1")

    def failing(fd):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", failing)
    monkeypatch.setattr(reliability, "_fsync_unsupported_warned", False)
    if raised:  # the bytes may not have reached the disk: the save must fail
        with pytest.raises(OSError, match=os.strerror(code)):
            reliability.fsync_tree(str(tmp_path))
    else:  # a filesystem without fsync (some FUSE/network ones): nothing to make durable, the save goes on
        assert reliability.fsync_tree(str(tmp_path)) == 2


class _FailGenerationAfter(TrainerCallback):
    """From optimizer step ``step`` on, the trainer's generation backend answers every call with ``answer``:
    an exception to raise, or a callable taking the real samples that returns broken ones."""

    def __init__(self, step, answer):
        self.step, self.answer, self.trainer = step, answer, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != self.step:
            return
        backend = self.trainer.generation_backend
        sample = backend.sample

        def broken(*a, **k):
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer(sample(*a, **k))

        backend.sample = broken


def test_a_generation_failure_saves_the_last_complete_update_and_names_it(kit, tmp_path):
    """A generation backend that fails mid-run (what the vLLM engine raises when it dies) ends train() with
    its error plus where the last complete update was saved (save_strategy='no' notwithstanding); a resumed
    run trains the remaining updates from that checkpoint. With save_on_interrupt=False nothing is saved."""
    from rlhf_trainers.generation import GenerationError

    failure = _FailGenerationAfter(2, GenerationError("the engine died (simulated)"))
    trainer = _ppo(kit, tmp_path, callbacks=[failure], max_steps=4)
    failure.trainer = trainer
    with pytest.raises(
        GenerationError, match=r"(?s)engine died.*step 2.*checkpoint-2.*resume_from_checkpoint"
    ):
        trainer.train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert (checkpoint / "trainer_state.json").is_file()
    resumed = _ppo(kit, tmp_path, max_steps=4)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 4

    failure = _FailGenerationAfter(1, GenerationError("the engine died (simulated)"))
    trainer = _ppo(kit, tmp_path / "off", callbacks=[failure], save_on_interrupt=False)
    failure.trainer = trainer
    with pytest.raises(GenerationError, match=r"No checkpoint was written \(save_on_interrupt=False\)"):
        trainer.train()
    assert not (tmp_path / "off" / "out").exists() or not any((tmp_path / "off" / "out").iterdir())


def test_a_backend_returning_fewer_rows_is_an_error(kit, tmp_path):
    """Samples short of the prompts' rows (an engine that dropped requests) stop the run with an error
    naming the shapes, before a short batch reaches the advantages."""
    from dataclasses import replace

    from rlhf_trainers.generation import GenerationError

    failure = _FailGenerationAfter(1, lambda samples: replace(samples, tokens=samples.tokens[:-1]))
    trainer = _ppo(kit, tmp_path, callbacks=[failure])
    failure.trainer = trainer
    with pytest.raises(GenerationError, match=r"(?s)completions of shape \(7, 8\) for 8 prompts.*step 1"):
        trainer.train()


def test_save_on_interrupt_false_keeps_the_default_handlers(kit, tmp_path):
    before = signal.getsignal(signal.SIGINT)
    seen = []

    class Look(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(signal.getsignal(signal.SIGINT))

    trainer = _ppo(kit, tmp_path, max_steps=1, save_on_interrupt=False, callbacks=[Look()])
    trainer.train()
    assert seen == [before]
    trainer = _ppo(kit, tmp_path, max_steps=1, callbacks=[Look()])
    trainer.train()
    assert seen[-1] != before  # installed during train() ...
    assert signal.getsignal(signal.SIGINT) == before  # ... and restored after


def test_reliability_fields_are_validated():
    with pytest.raises(ValueError, match="max_nonfinite_steps must be >= 0"):
        PPOConfig(output_dir="x", max_nonfinite_steps=-1, use_cpu=True)
    with pytest.raises(ValueError, match="reward_func_errors='ignore'"):
        PPOConfig(output_dir="x", reward_func_errors="ignore", use_cpu=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "updates", "save_steps"),
    [("ppo", 120, 20), ("rloo", 60, 15), ("grpo", 100, 20), ("reward", 100, 20)],
)
def test_memory_does_not_grow_over_a_run(kind, updates, save_steps, tmp_path):
    """A shorter form of benchmarks/long_run_memory.py (1,000 updates, within 5 %) for each trainer: 60-120
    updates with a checkpoint every `save_steps`, the second half's peak RSS within 10 % of the first
    half's."""
    script = Path(__file__).parents[1] / "benchmarks" / "long_run_memory.py"
    args = ["--trainer", kind, "--updates", updates, "--save-steps", save_steps, "--out", tmp_path]
    proc = forked.run(script, args, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=900)
    _ok(proc)
    report = json.loads((tmp_path / f"long_run_memory_{kind}.json").read_text())
    assert len(report["rss_mib"]) == updates
    assert report["ratio"] < 1.10, report
