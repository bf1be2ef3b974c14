"""A new user's first mistakes give one clear, early line (issue #49): a model path that names nothing,
a bad command-line value, a dataset without a prompt column, bad optimizer settings, and several
problems of one config at once. In Python the trainers and configs raise; on the command line the error
is printed first, without a usage dump or a traceback, with flag names in the fix."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import transformers

from rlhf_trainers import GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer, RewardConfig, RewardTrainer
from rlhf_trainers.cli import main
from rlhf_trainers.config_problems import ConfigError
from rlhf_trainers.model_paths import ModelNotFoundError, check_model_path
from rlhf_trainers.scripts._common import usage_errors
from rlhf_trainers.testing import true_reward

REPO_ROOT = Path(__file__).resolve().parent.parent
QUIET = ["--use_cpu", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"]


def _prompts() -> datasets.Dataset:
    return datasets.Dataset.from_dict({"prompt": ["the film was", "the food is"]})


def _cli_error(capsys, argv: list[str]) -> str:
    """The one error of `argv` on the command line: exit status 2, the error line first, a pointer to
    --help, no usage dump and no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" not in err and "Traceback" not in err
    # Our output starts at the error line (a dataset being read may have printed progress before).
    err = err[err.index(f"rlhf-trainers {argv[0]}: error: ") :]
    assert err.strip().splitlines()[-1] == f"Run `rlhf-trainers {argv[0]} --help` for the flags."
    return err


def _forbid_loading(monkeypatch) -> None:
    """Make loading any model or tokenizer fail the test: the error must come before."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"a model or tokenizer was loaded before the error: {args}")

    for auto_class in (transformers.AutoModelForCausalLM, transformers.AutoModelForSequenceClassification):
        monkeypatch.setattr(auto_class, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)


# ---- model paths: Python ------------------------------------------------------------------------


@pytest.mark.parametrize("keyword", ["model", "ref_model", "reward_model", "value_model"])
def test_a_missing_model_folder_fails_at_ppo_construction_naming_it(kit, tmp_path, monkeypatch, keyword):
    monkeypatch.chdir(tmp_path)
    models = {"model": str(kit.model_path("llama-sft")), "reward_model": str(kit.model_path("llama-seqcls"))}
    models[keyword] = "./my-sft-model"
    config = PPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none")
    with pytest.raises(ModelNotFoundError) as error:
        PPOTrainer(**models, args=config, train_dataset=_prompts())
    message = str(error.value)
    assert message.startswith(
        f"{keyword}='./my-sft-model': the folder {tmp_path / 'my-sft-model'} does not exist."
    )
    assert "save_pretrained" in message and "Hub model id" in message  # what to pass
    assert isinstance(error.value, FileNotFoundError) and isinstance(error.value, ValueError)


@pytest.mark.parametrize(
    ("reward_funcs", "named"),
    [("./rm", "reward_funcs='./rm'"), ([true_reward, "./models/rm"], "reward_funcs[1]='./models/rm'")],
)
def test_grpo_reward_funcs_naming_a_missing_folder_fail_at_construction(kit, tmp_path, reward_funcs, named):
    config = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none")
    with pytest.raises(ModelNotFoundError, match="^" + re.escape(named) + ": the folder"):
        GRPOTrainer(
            str(kit.model_path("llama-sft")), reward_funcs=reward_funcs, args=config, train_dataset=_prompts()
        )


def test_a_bare_word_in_reward_funcs_says_how_a_string_names_a_reward_model(kit, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none")
    with pytest.raises(
        TypeError, match=r"got str: 'rm'\. A string names a reward model only as a folder path \(\./rm\)"
    ):
        GRPOTrainer(
            str(kit.model_path("llama-sft")), reward_funcs="rm", args=config, train_dataset=_prompts()
        )


def test_reward_trainer_refuses_a_missing_model_folder(tmp_path):
    pairs = datasets.Dataset.from_dict({"chosen": ["good"], "rejected": ["bad"]})
    config = RewardConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none")
    with pytest.raises(
        ModelNotFoundError, match=r"^model='/nowhere/rm': the folder /nowhere/rm does not exist"
    ):
        RewardTrainer(model="/nowhere/rm", args=config, train_dataset=pairs)


def test_a_folder_without_a_model_points_at_its_checkpoints(tmp_path):
    (tmp_path / "run" / "checkpoint-8").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint-8" / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match=r"holds no config\.json.*checkpoint-8 hold a model"):
        check_model_path(str(tmp_path / "run"), "model")
    with pytest.raises(ModelNotFoundError, match=r"is a file; a model is a folder"):
        check_model_path(str(tmp_path / "run" / "checkpoint-8" / "config.json"), "model")
    check_model_path(str(tmp_path / "run" / "checkpoint-8"), "model")  # a model folder passes


def test_a_tilde_path_asks_for_the_full_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "sft").mkdir()
    with pytest.raises(
        ModelNotFoundError, match=rf"'~' is not expanded .* pass the full path, {tmp_path / 'sft'}\.$"
    ):
        check_model_path("~/sft", "model")


def test_a_misspelt_folder_gets_a_suggestion(tmp_path):
    (tmp_path / "my-sft-model").mkdir()
    with pytest.raises(ModelNotFoundError, match=rf"Did you mean {tmp_path / 'my-sft-model'}\?"):
        check_model_path(str(tmp_path / "my-sft-modle"), "model")


def test_a_hub_id_offline_is_refused_unless_it_is_in_the_hub_cache(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as error:
        check_model_path("my-sft-model", "model", model_kwargs={"cache_dir": str(tmp_path / "hub")})
    message = str(error.value)
    assert message.startswith("model='my-sft-model': neither a folder (no ./my-sft-model in")
    assert "HF_HUB_OFFLINE=1 is set" in message and "hf download" in message
    # The same id, present in the Hub cache (the layout huggingface_hub writes), is accepted.
    snapshot = tmp_path / "hub" / "models--owner--name" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--owner--name" / "refs").mkdir()
    (tmp_path / "hub" / "models--owner--name" / "refs" / "main").write_text("abc123")
    check_model_path("owner/name", "model", model_kwargs={"cache_dir": str(tmp_path / "hub")})


def test_a_hub_id_the_hub_cannot_serve_says_the_hub_cannot_be_reached(tmp_path):
    # A closed local port as the Hub: the connection is refused at once.
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_CACHE": str(tmp_path / "hub")}
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("TRANSFORMERS_OFFLINE", None)
    code = "from rlhf_trainers.model_paths import check_model_path; check_model_path('owner/name', 'model')"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "ModelNotFoundError: model='owner/name': neither a folder" in done.stderr
    assert "the Hub cannot be reached" in done.stderr


# ---- model paths: command line ------------------------------------------------------------------


def test_the_cli_refuses_a_missing_model_folder_in_two_lines_before_loading_anything(tmp_path):
    """The issue's report, run as a user does: the example of docs/cli.md with a folder that does not exist."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    argv = [sys.executable, "-m", "rlhf_trainers.cli", "ppo", "--model_name_or_path", "./my-sft-model"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"rlhf-trainers ppo: error: --model_name_or_path ./my-sft-model: the folder {tmp_path / 'my-sft-model'} "
        "does not exist. Pass a folder saved with save_pretrained (one holding config.json, e.g. written by "
        "`rlhf-trainers reward` or trainer.save_model) or a Hub model id such as 'Qwen/Qwen2.5-0.5B-Instruct'.",
        "Run `rlhf-trainers ppo --help` for the flags.",
    ]


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["ppo", "--reward_model_name_or_path", "./rm"], "--reward_model_name_or_path ./rm"),
        (["ppo", "--value_model_name_or_path", "./vm"], "--value_model_name_or_path ./vm"),
        (["grpo", "--reward_model_name_or_path", "./rm"], "--reward_model_name_or_path ./rm"),
        (["reward", "--model_name_or_path", "./rm"], "--model_name_or_path ./rm"),
    ],
)
def test_every_model_flag_is_checked(tmp_path, monkeypatch, capsys, argv, flag):
    monkeypatch.chdir(tmp_path)
    _forbid_loading(monkeypatch)
    err = _cli_error(capsys, [*argv, "--output_dir", str(tmp_path / "out"), *QUIET])
    assert f"error: {flag}: the folder {tmp_path / flag.split('./')[1]} does not exist." in err


# ---- configuration errors on the command line ---------------------------------------------------


def test_a_dataset_without_a_prompt_column_names_the_flag_that_fixes_it(tmp_path, capsys):
    data = tmp_path / "texts.jsonl"
    data.write_text('{"text": "the film was"}\n{"text": "the food is"}\n')
    err = _cli_error(
        capsys, ["rloo", "--dataset_name", str(data), "--output_dir", str(tmp_path / "o"), *QUIET]
    )
    assert "no prompt column" in err and "its columns are ['text']" in err
    assert "--prompt_column text" in err and "rename_column" not in err


def test_a_negative_learning_rate_is_refused_when_parsing(tmp_path, monkeypatch, capsys):
    _forbid_loading(monkeypatch)
    err = _cli_error(capsys, ["ppo", "--learning_rate", "-1", "--output_dir", str(tmp_path)])
    assert "error: --learning_rate -1.0: expected a finite number >= 0" in err


def test_every_problem_of_a_config_is_listed_at_once(tmp_path, capsys):
    argv = [
        "grpo",
        "--num_generations",
        "1",
        "--max_steps",
        "2",
        "--adam_beta2",
        "1",
        "--output_dir",
        str(tmp_path),
    ]
    err = _cli_error(capsys, argv)
    assert "GRPOConfig has 3 problems:" in err
    assert "  - --num_generations 1: GRPO's baseline" in err and "set --num_generations 2 or more" in err
    assert "  - --max_steps 2: one generation here is 4 optimizer steps" in err
    assert "  - --adam_beta2 1.0: expected a number in [0, 1)" in err


def test_the_demo_and_kit_commands_print_their_errors_first_too(capsys):
    assert "unknown flag(s): --bogus." in _cli_error(capsys, ["demo", "--bogus"])
    assert "--kit_dir/--kit-dir: expected one argument" in _cli_error(capsys, ["kit", "--kit_dir"])


def test_a_value_error_from_outside_the_package_keeps_its_traceback():
    namespace: dict = {}
    exec(
        compile("def fail():\n    raise ValueError('a bug elsewhere')\n", "/elsewhere/lib.py", "exec"),
        namespace,
    )
    with pytest.raises(ValueError, match="a bug elsewhere"), usage_errors("prog", ["flag"]):
        namespace["fail"]()


# ---- configuration errors in Python -------------------------------------------------------------


@pytest.mark.parametrize("config_class", [PPOConfig, GRPOConfig, RewardConfig])
def test_optimizer_settings_are_checked_when_the_config_is_built(tmp_path, config_class):
    bad = {
        "learning_rate": -1.0,
        "weight_decay": -0.1,
        "adam_beta1": 1.0,
        "adam_epsilon": -1e-8,
        "max_grad_norm": -1.0,
    }
    with pytest.raises(ConfigError) as error:
        config_class(output_dir=str(tmp_path), **bad)
    assert [problem.split("=")[0] for problem in error.value.problems] == list(bad)
    assert str(error.value).startswith(f"{config_class.__name__} has 5 problems:\n  - learning_rate=-1.0: ")


def test_grpo_config_reports_num_generations_and_max_steps_together(tmp_path):
    with pytest.raises(ValueError) as error:
        GRPOConfig(output_dir=str(tmp_path), num_generations=1, max_steps=3, num_iterations=2)
    problems = error.value.problems
    assert len(problems) == 2
    assert problems[0].startswith("num_generations=1: ") and problems[1].startswith("max_steps=3: ")
