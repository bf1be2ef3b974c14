"""The training display (``rlhf_trainers.display``, issue #49): one progress bar with the key figures and a
summary at the end instead of a metrics dict per update; the dicts with ``--disable_tqdm true``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from transformers import TrainerControl, TrainerState
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from rlhf_trainers import RLOOConfig, RLOOTrainer
from rlhf_trainers.cli import main
from rlhf_trainers.display import TrainingDisplay
from rlhf_trainers.testing import true_reward

# The kit runs of the "done when": 10 updates of each (GRPO's max_steps counts optimizer steps,
# 4 per update with the kit defaults), and the figures each one's bar and summary must show.
KIT_RUNS = {
    "rloo": ("10", ["reward=", "kl=", "clipfrac="]),
    "ppo": ("10", ["reward=", "kl=", "value_loss=", "clipfrac="]),
    "grpo": ("40", ["reward=", "reward_std="]),
}


def _env() -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    return {k: v for k, v in env.items() if not k.startswith("ACCELERATE_")}


@pytest.mark.parametrize("command", sorted(KIT_RUNS))
def test_a_kit_run_prints_a_bar_and_a_summary_in_under_40_lines(kit, tmp_path, command):
    """`rlhf-trainers <command>` on the kit with the default display: stdout and stderr together (every
    warning and library bar included) hold under 40 lines, the live figures, the summary, and no metric
    dict. Lines are counted as a log file shows them: the bar redraws in place (carriage returns)."""
    steps, figures = KIT_RUNS[command]
    out = tmp_path / "out"
    argv = [
        sys.executable,
        "-m",
        "rlhf_trainers.cli",
        command,
        "--max_steps",
        steps,
        "--output_dir",
        str(out),
    ]
    argv += ["--use_cpu", "true", "--report_to", "none", "--seed", "0"]
    done = subprocess.run(argv, env=_env(), cwd=tmp_path, capture_output=True, timeout=600)
    output = (done.stdout + done.stderr).decode()
    assert done.returncode == 0, output[-3000:]
    assert output.count("\n") < 40, output
    # where a log turns every redraw into a line (a CI log), the bar adds one line per update, not two
    assert output.count("\n") + output.count("\r") < 70, output
    for figure in figures:  # live, in the bar's postfix ...
        assert figure in output, (figure, output)
        label = figure.rstrip("=")  # ... and in the summary, first -> last logged
        assert any(line.strip().startswith(label + " ") and "->" in line for line in output.splitlines()), (
            label
        )
    assert f"{command.upper()} finished: {steps} step(s)" in output
    assert f"saved in {out}: checkpoint-{steps}, samples.jsonl" in output
    # one sample table as the run starts, the latest in the summary; every one in samples.jsonl
    assert output.count("sample completions at update") == 2
    assert len((out / "samples.jsonl").read_text().splitlines()) == 4 * 10
    # no metric dict, no JSON dump: the CLI's last lines are the eval reward and the paths
    assert "'objective/kl'" not in output and '"world_size"' not in output
    assert "eval reward (objective/scores on the test split):" in output
    results = json.loads((out / "results.json").read_text())
    assert results["global_step"] == int(steps) and "objective/scores" in results["train"]


def test_disable_tqdm_prints_every_log_as_a_dict_and_the_json(kit, tmp_path, capsys):
    """The plain output transformers users know: a dict per log (PrinterCallback), every sample table,
    the CLI's JSON; no bar, no summary."""
    argv = ["rloo", "--max_steps", "3", "--output_dir", str(tmp_path / "out"), "--use_cpu", "true"]
    argv += ["--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true", "--seed", "0"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert sum("'objective/kl'" in line for line in out.splitlines()) == 3
    assert "'train_runtime'" in out
    assert out.count("sample completions at update") == 3
    assert "finished:" not in out
    assert json.loads(out[out.index('{\n  "world_size"') :])["global_step"] == 3
    assert not (tmp_path / "out" / "results.json").exists()  # printed, not written: no --results_file


def _state(main_process: bool = True, max_steps: int = 4) -> TrainerState:
    state = TrainerState(is_world_process_zero=main_process, is_local_process_zero=main_process)
    state.max_steps = max_steps
    return state


def _run(display: TrainingDisplay, state: TrainerState, logs: list[dict], output_dir: str) -> None:
    """Drive `display` through a run of len(logs) steps, one log each, the eval entries logged at the
    step of the train entry before them."""
    args = SimpleNamespace(output_dir=output_dir, save_strategy="steps")
    control = TrainerControl()
    display.on_train_begin(args, state, control)
    for entry in logs:
        if not any(k.startswith("eval_") for k in entry):
            state.global_step += 1
            display.on_step_end(args, state, control)
        display.on_log(args, state, control, logs=entry)
    display.on_log(args, state, control, logs={"train_runtime": 75.0, "train_loss": 0.1})
    display.on_train_end(args, state, control)


def test_the_summary_compares_first_and_last_and_names_what_was_saved(tmp_path, capsys):
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-4").mkdir()
    display = TrainingDisplay("PPO", {"objective/scores": "reward", "objective/kl": "kl"}, steps_per_update=2)
    logs = [
        {"objective/scores": -0.5, "objective/kl": 0.0, "other": 1.0},
        {"objective/scores": 0.25, "objective/kl": 0.5},
        {"eval_objective/scores": 0.2, "eval_runtime": 1.0},
        {"objective/scores": 0.75, "objective/kl": 1.5},
        {"objective/scores": 0.875},
        {"eval_objective/scores": 0.8},
    ]
    kept = [dict(entry) for entry in logs]
    _run(display, _state(), logs, str(tmp_path))
    assert logs == kept  # the display does not touch the logs other callbacks and log_history see
    out = capsys.readouterr().out
    assert "eval at step 2: reward 0.2" in out and "eval at step 4: reward 0.8" in out
    summary = out[out.index("PPO finished") :].splitlines()
    assert summary[0] == "PPO finished: 4 step(s) = 2 update(s) in 1 min 15 s"
    assert summary[1].split() == ["reward", "-0.5", "(step", "1)", "->", "0.875", "(step", "4)"]
    assert summary[2].split() == ["kl", "0", "(step", "1)", "->", "1.5", "(step", "3)"]
    assert summary[3] == "  eval reward: 0.2 (step 2) -> 0.8 (step 4)"
    assert summary[4] == f"  saved in {tmp_path}: checkpoint-4 (and 1 older)"
    assert "'other'" not in out and "{" not in out


def test_a_stopped_run_says_so_and_names_the_missing_model(tmp_path, capsys):
    display = TrainingDisplay("RLOO", {"objective/scores": "reward"})
    _run(display, _state(max_steps=10), [{"objective/scores": 1.0}], str(tmp_path))
    out = capsys.readouterr().out
    assert "RLOO finished: 1 step(s) in 1 min 15 s (stopped at step 1 of 10)" in out
    assert "  reward  1 (step 1)\n" in out  # one value logged: no first -> last
    assert "no checkpoint (save_strategy='steps'): trainer.save_model() writes the model" in out


def test_sample_tables_first_printed_latest_in_the_summary(tmp_path, capsys):
    display = TrainingDisplay("GRPO", {"reward": "reward"})
    args, state, control = (
        SimpleNamespace(output_dir=str(tmp_path), save_strategy="no"),
        _state(),
        TrainerControl(),
    )
    display.on_train_begin(args, state, control)
    for update in range(3):
        display.show_samples(f"table {update}")
    display.on_train_end(args, state, control)
    out = capsys.readouterr().out
    assert "table 0" in out and "table 1" not in out
    assert out.rstrip().endswith("table 2")  # the summary's last lines
    display.show_samples("outside train")  # (evaluate's tables are logged, but a direct call prints)
    assert "outside train" in capsys.readouterr().out


def test_other_processes_print_nothing(tmp_path, capsys):
    display = TrainingDisplay("PPO", {"objective/scores": "reward"})
    logs = [{"objective/scores": 1.0}, {"eval_objective/scores": 2.0}]
    _run(display, _state(main_process=False), logs, str(tmp_path))
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_steps_per_update_must_be_positive():
    with pytest.raises(ValueError, match="steps_per_update must be >= 1, got 0"):
        TrainingDisplay("PPO", {}, steps_per_update=0)


def _rloo(kit, tmp_path, **config) -> RLOOTrainer:
    fields = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 8,
        "num_mini_batches": 1,
        "num_ppo_epochs": 1,
        "response_length": 8,
        "max_steps": 2,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "seed": 0,
        "num_sample_generations": 0,
        "eval_strategy": "steps",
        "eval_steps": 2,
        **config,
    }
    return RLOOTrainer(
        model=kit.load_model("llama-sft"),
        processing_class=kit.load_tokenizer(),
        args=RLOOConfig(**fields),
        train_dataset=kit.prompt_dataset("train", n=32),
        eval_dataset=kit.prompt_dataset("test", n=8),
        reward_funcs=true_reward,
    )


def test_the_trainer_prints_a_summary_and_evaluate_prints_nothing(kit, tmp_path, capsys):
    """The Python API: train() shows the bar (stderr) and prints the summary, the evaluation during
    training as one line; evaluate() prints nothing; log_history keeps every metric."""
    trainer = _rloo(kit, tmp_path)
    kinds = [type(callback) for callback in trainer.callback_handler.callbacks]
    assert TrainingDisplay in kinds and ProgressCallback not in kinds and PrinterCallback not in kinds
    trainer.train()
    captured = capsys.readouterr()
    assert "RLOO:" in captured.err and "reward=" in captured.err  # the bar
    assert "RLOO finished: 2 step(s)" in captured.out and "eval at step 2: reward " in captured.out
    assert "{" not in captured.out + captured.err  # no dict
    assert "objective/rlhf_reward" in trainer.state.log_history[0]
    trainer.evaluate()
    captured = capsys.readouterr()
    assert captured.out == "" and "eval_" not in captured.err


def test_disable_tqdm_keeps_transformers_printer(kit, tmp_path):
    trainer = _rloo(kit, tmp_path, disable_tqdm=True)
    kinds = [type(callback) for callback in trainer.callback_handler.callbacks]
    assert PrinterCallback in kinds and TrainingDisplay not in kinds and trainer.display is None


def test_in_jupyter_the_display_replaces_the_notebook_table(kit, tmp_path, monkeypatch):
    """In a notebook transformers adds NotebookProgressCallback (an HTML table of every logged metric)."""
    pytest.importorskip("IPython")
    import transformers.trainer
    from transformers.utils.notebook import NotebookProgressCallback

    monkeypatch.setattr(transformers.trainer, "DEFAULT_PROGRESS_CALLBACK", NotebookProgressCallback)
    trainer = _rloo(kit, tmp_path)
    kinds = [type(callback) for callback in trainer.callback_handler.callbacks]
    assert NotebookProgressCallback not in kinds and kinds.count(TrainingDisplay) == 1


def test_values_show_three_digits_and_round_off_as_zero() -> None:
    from rlhf_trainers.display import format_value

    assert format_value(0.123456) == "0.123"
    assert format_value(3.09) == "3.09"
    assert format_value(-1.25e-07) == "0"  # float32 round-off of a zero KL, not a figure to read
    assert format_value(2.5e-5) == "2.5e-05"  # a learning rate stays readable
    assert format_value(20) == "20"
