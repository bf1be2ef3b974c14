"""``rlhf-trainers reward|ppo|rloo`` (``rlhf_trainers.scripts``) and the ``examples/*.py`` that wrap them:
``--help`` documents every config field, training on local model and dataset files, the offline kit's
defaults, and clear errors for bad flags and paths."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_trainers import CPUOptions, GRPOConfig, PPOConfig, RewardConfig, RLOOConfig
from rlhf_trainers.cli import main
from rlhf_trainers.models import load_reward_model
from rlhf_trainers.scripts import ppo as ppo_script
from rlhf_trainers.scripts._common import (
    DatasetArguments,
    LoraArguments,
    OnPolicyScriptArguments,
    load_splits,
    parse_args,
)
from rlhf_trainers.scripts.ppo import PPOScriptArguments
from rlhf_trainers.scripts.reward import RewardScriptArguments

REPO_ROOT = Path(__file__).resolve().parent.parent

# What every command parses: its script arguments, the dataset and LoRA flags, its trainer's config (at
# CONFIG) and the CPU speed switches.
COMMANDS = {
    "reward": (RewardScriptArguments, DatasetArguments, LoraArguments, RewardConfig, CPUOptions),
    "ppo": (PPOScriptArguments, DatasetArguments, LoraArguments, PPOConfig, CPUOptions),
    "rloo": (OnPolicyScriptArguments, DatasetArguments, LoraArguments, RLOOConfig, CPUOptions),
    "grpo": (OnPolicyScriptArguments, DatasetArguments, LoraArguments, GRPOConfig, CPUOptions),
}
CONFIG = 3
EXAMPLES = {"reward": "reward_modeling.py", "ppo": "ppo.py", "rloo": "rloo.py", "grpo": "grpo.py"}

# Small, quiet, CPU-only runs.
QUIET = ["--use_cpu", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true", "--seed", "0"]


def _squeeze(text: str) -> str:
    """`text` without whitespace: argparse re-wraps help text (and may break lines at hyphens)."""
    return "".join(text.split())


def _as_printed(help_text: str) -> str:
    """A field's help as argparse prints it: the text is %-formatted, so "%%" shows as "%"."""
    return help_text.replace("%%", "%")


def _help(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_usage_lists_the_trainer_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in COMMANDS:
        assert f"  {command} " in out, command
    assert "accelerate launch" in out and "-m rlhf_trainers.cli" in out


@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_documents_every_config_field(command, capsys):
    out = _help(capsys, [command, "--help"])
    assert out.startswith(f"usage: rlhf-trainers {command} ")
    squeezed = _squeeze(out)
    config_class = COMMANDS[command][CONFIG]
    documented = 0
    for dataclass_type in COMMANDS[command]:
        for f in dataclasses.fields(dataclass_type):
            assert f.init, f"{dataclass_type.__name__}.{f.name} is not a flag (init=False)"
            help_text = f.metadata.get("help")
            assert help_text, f"{dataclass_type.__name__}.{f.name} has no help text"
            assert f"--{f.name} " in out or f"--{f.name}," in out, f.name
            assert _squeeze(_as_printed(help_text)) in squeezed, (
                f"help of --{f.name} missing from `{command} --help`"
            )
            documented += dataclass_type is config_class
    assert documented == len(dataclasses.fields(config_class)) > 100


@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_lists_the_trainers_own_settings_before_the_inherited_ones(command, capsys):
    from transformers import TrainingArguments

    out = _help(capsys, [command, "--help"])
    config_class = COMMANDS[command][CONFIG]
    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    own = [f.name for f in dataclasses.fields(config_class) if f.name not in inherited]
    own_title = f"{config_class.__name__} (this trainer's settings):"
    inherited_title = "transformers.TrainingArguments (inherited):"
    assert own and out.index(own_title) < out.index(inherited_title)

    def entry(name: str) -> int:  # where the flag's help entry starts (not its mention in the usage line)
        return re.search(rf"\n {{2}}--{name}\b", out).start()

    # Every own flag is printed between the two titles, every inherited one after the second.
    for name in own:
        assert out.index(own_title) < entry(name) < out.index(inherited_title), name
    for name in ("output_dir", "learning_rate", "per_device_train_batch_size"):
        assert entry(name) > out.index(inherited_title), name


@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_lists_the_cpu_switches_last_in_their_own_group(command, capsys):
    out = _help(capsys, [command, "--help"])
    title = f"{CPUOptions._argument_group_name}:"
    assert out.index(title) > out.index("transformers.TrainingArguments (inherited):")
    for f in dataclasses.fields(CPUOptions):
        assert re.search(rf"\n {{2}}--{f.name}\b", out).start() > out.index(title), f.name


def test_the_cpu_flags_keep_their_names_and_reach_cpu_options():
    argv = ["--output_dir", "unused", "--mkl_prepacked_decoding", "true", "--lean-decoding", "false"]
    argv += [
        "--onednn_linear_min_weights",
        "0",
        "--reuse_host_memory",
        "true",
        "--drop_finished_rows",
        "false",
    ]
    *_, config, options = parse_args(COMMANDS["ppo"], argv)
    assert isinstance(config, PPOConfig) and not hasattr(config, "lean_decoding")
    assert options == CPUOptions(
        mkl_prepacked_decoding=True,
        lean_decoding=False,
        onednn_linear_min_weights=0,
        reuse_host_memory=True,
        drop_finished_rows=False,
    )
    *_, defaults = parse_args(COMMANDS["grpo"], ["--output_dir", "unused"])
    assert defaults == CPUOptions()


@pytest.mark.parametrize("command", list(COMMANDS))
def test_examples_are_the_same_commands(command, monkeypatch, capsys):
    """examples/*.py run the installed scripts: the same flags under the file's name."""
    path = REPO_ROOT / "examples" / EXAMPLES[command]
    assert len(path.read_text().splitlines()) < 60  # a docstring and a call, no second copy of the logic
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(path), run_name="__main__")
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {path.name} ")
    assert "--dataset_name" in out and "--use_peft" in out
    assert (command == "rloo") == ("--rloo_k" in out)
    assert (command == "grpo") == ("--loss_type" in out)
    assert (command == "ppo") == ("--value_model_name_or_path" in out)


def test_kit_defaults_apply_only_on_the_kit_and_only_to_flags_not_given():
    types = COMMANDS["ppo"]

    def config(*argv: str) -> PPOConfig:
        return parse_args(types, ["--output_dir", "unused", *argv], kit_defaults=ppo_script.KIT_DEFAULTS)[
            CONFIG
        ]

    on_kit = config()
    for name, value in ppo_script.KIT_DEFAULTS.items():
        assert getattr(on_kit, name) == value, name
    given = config("--learning-rate", "1e-4", "--num_ppo_epochs=3")  # both spellings, with and without '='
    assert (given.learning_rate, given.num_ppo_epochs, given.response_length) == (1e-4, 3, 12)
    hub_model = config("--model_name_or_path", "some/model")
    defaults = PPOConfig(output_dir="unused")
    for name in ppo_script.KIT_DEFAULTS:
        assert getattr(hub_model, name) == getattr(defaults, name), name


def test_lora_flags_become_a_peft_config():
    assert LoraArguments().peft_config("CAUSAL_LM") is None
    lora = LoraArguments(use_peft=True, lora_r=4, lora_alpha=8, lora_target_modules="q_proj, v_proj,")
    config = lora.peft_config("SEQ_CLS")
    assert (config.r, config.lora_alpha, config.task_type) == (4, 8, "SEQ_CLS")
    assert set(config.target_modules) == {"q_proj", "v_proj"}
    assert LoraArguments(use_peft=True).peft_config("CAUSAL_LM").target_modules == "all-linear"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["ppo", "--lerning_rate", "1e-3"], ["--lerning_rate", "did you mean --learning_rate"]),
        (["reward", "--use_pef"], ["--use_pef", "did you mean --use_peft"]),
        (["rloo", "--max_steps", "2", "3"], ["the value '3', which follows no flag"]),
        (["rloo", "--rloo_k", "1"], ["--rloo_k 1", "set --rloo_k 2 or more"]),
        (["ppo", "--learning_rate", "fast"], ["--learning_rate", "invalid float value: 'fast'"]),
        (["ppo", "--lora_r", "0"], ["--lora_r 0", "at least 1"]),
        (["reward", "--max_train_samples", "0"], ["--max_train_samples 0", "positive number"]),
    ],
)
def test_bad_flags_exit_with_a_clear_message(argv, expected, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--output_dir", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    # The error comes first, with a pointer to --help, and no usage dump.
    assert err.startswith(f"rlhf-trainers {argv[0]}: error: ")
    assert err.splitlines()[-1] == f"Run `rlhf-trainers {argv[0]} --help` for the flags."
    assert "usage:" not in err and len(err.splitlines()) == 2
    for text in expected:
        assert text in err, (text, err[-600:])
    assert "Traceback" not in err


def test_dataset_name_reads_files_and_folders(tmp_path):
    rows = {"prompt": [f"prompt {i}" for i in range(5)]}
    one_file = tmp_path / "prompts.csv"
    datasets.Dataset.from_dict(rows).to_csv(str(one_file), index=False)
    files = tmp_path / "files"  # a folder of data files: splits from the file names
    files.mkdir()
    datasets.Dataset.from_dict(rows).to_json(str(files / "train.jsonl"))
    datasets.Dataset.from_dict({"prompt": ["held out"]}).to_json(str(files / "test.jsonl"))
    saved_dataset = tmp_path / "saved-dataset"
    datasets.Dataset.from_dict(rows).save_to_disk(str(saved_dataset))

    def splits(name: Path, **kwargs) -> tuple[list[str], list[str] | None]:
        train, test = load_splits(DatasetArguments(dataset_name=str(name), **kwargs))
        return list(train["prompt"]), None if test is None else list(test["prompt"])

    assert splits(one_file) == (rows["prompt"], None)  # one file: the train split, no evaluation
    assert splits(one_file, dataset_train_split="mine") == (rows["prompt"], None)
    assert splits(files) == (rows["prompt"], ["held out"])
    assert splits(files, dataset_test_split="none") == (rows["prompt"], None)
    assert splits(files, max_train_samples=2, max_eval_samples=9) == (rows["prompt"][:2], ["held out"])
    assert splits(saved_dataset) == (rows["prompt"], None)


def _usage_error(capsys, argv: list[str]) -> str:
    """The stderr of `argv`, which must exit as a usage error: status 2, no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"rlhf-trainers {argv[0]}: error: " in err
    return err


def test_bad_dataset_paths_and_splits_say_what_exists(kit, tmp_path, capsys):
    missing = tmp_path / "missing.jsonl"
    common = ["--output_dir", str(tmp_path / "out"), *QUIET]
    err = _usage_error(capsys, ["rloo", "--dataset_name", str(missing), *common])
    assert re.search(r"--dataset_name .*missing\.jsonl: no such file", err)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "the film was"}\n')
    folder = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": ["the film was"]})}).save_to_disk(
        folder
    )
    err = _usage_error(
        capsys, ["rloo", "--dataset_name", str(folder), "--dataset_train_split", "validation", *common]
    )
    assert re.search(r"no split 'validation'; its splits are \['train'\]", err)
    err = _usage_error(capsys, ["rloo", "--dataset_name", str(prompts), "--prompt_column", "query", *common])
    assert re.search(r"--prompt_column query: no such column .* \['prompt'\]", err)
    text_file = tmp_path / "prompts.txt"
    text_file.write_text("the film was\n")
    err = _usage_error(capsys, ["ppo", "--dataset_name", str(text_file), *common])
    assert re.search(r"ending in \.txt; a data file must end in one of \.json, \.jsonl", err)


def test_rloo_console_script_trains_on_a_local_model_and_a_local_prompt_file(kit, tmp_path):
    """The issue's "done when": ``rlhf-trainers rloo --model_name_or_path <local path> --dataset_name
    <local path>``, run as the installed console script outside the repository."""
    model_dir, prompts = tmp_path / "my-model", tmp_path / "prompts.jsonl"
    kit.load_model("llama-sft").save_pretrained(model_dir)
    kit.load_tokenizer().save_pretrained(model_dir)
    prompts.write_text(
        "".join(json.dumps({"prompt": p}) + "\n" for p in kit.prompt_dataset("train", n=64)["prompt"])
    )
    # The kit must not be needed: its folder cannot be created (a path under a file).
    (tmp_path / "a-file").write_text("")
    env = {**os.environ, "RLHF_TRAINERS_KIT_DIR": str(tmp_path / "a-file" / "kit"), "HF_HUB_OFFLINE": "1"}
    env.update({"HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    env = {k: v for k, v in env.items() if not k.startswith("ACCELERATE_")}
    out, results_file = tmp_path / "out", tmp_path / "results.json"
    console_script = Path(sys.executable).with_name("rlhf-trainers")
    assert console_script.is_file(), f"{console_script} missing: is the package installed (pip install -e .)?"
    # The console script runs without the repository on sys.path.
    env["PYTHONPATH"] = ""
    # 2 updates of 2 prompts x 4 completions; the policy's config for all the rest (a local model: no kit defaults)
    command = [
        str(console_script),
        "rloo",
        "--model_name_or_path",
        str(model_dir),
        "--dataset_name",
        str(prompts),
    ]
    command += [
        "--output_dir",
        str(out),
        "--max_steps",
        "2",
        "--rloo_k",
        "4",
        "--per_device_train_batch_size",
        "8",
    ]
    command += [
        "--response_length",
        "8",
        "--learning_rate",
        "1e-3",
        "--num_ppo_epochs",
        "1",
        "--temperature",
        "1.0",
    ]
    command += ["--num_sample_generations", "0", "--results_file", str(results_file), *QUIET]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(results_file.read_text())
    assert (results["global_step"], results["world_size"]) == (2, 1)
    assert "before" not in results and "after" not in results  # one file: a train split only
    assert "objective/rlhf_reward" in results["train"]
    assert json.loads(done.stdout[done.stdout.index('{\n  "world_size"') :]) == results  # printed as well

    trained = AutoModelForCausalLM.from_pretrained(out)
    assert AutoTokenizer.from_pretrained(out).pad_token == "<|pad|>"
    initial = _weights(AutoModelForCausalLM.from_pretrained(model_dir))
    changed = [n for n, p in trained.named_parameters() if not torch.equal(p, initial[n])]
    assert len(changed) == len(initial), "every weight of the policy should have moved"


def test_ppo_on_a_saved_dataset_dict_with_a_prompt_column_and_a_test_split(kit, tmp_path, capsys):
    folder = tmp_path / "prompts"
    data = datasets.DatasetDict(
        {
            "train": kit.prompt_dataset("train", n=64).rename_column("prompt", "query"),
            "test": kit.prompt_dataset("test", n=40).rename_column("prompt", "query"),
        }
    )
    data.save_to_disk(str(folder))
    out = tmp_path / "out"
    # The kit's model (no --model_name_or_path): the kit defaults apply but for the batch, made smaller here.
    argv = ["--dataset_name", str(folder), "--prompt_column", "query", "--max_eval_samples", "8"]
    argv += ["--per_device_train_batch_size", "8", "--num_mini_batches", "1", "--num_ppo_epochs", "1"]
    argv += ["--output_dir", str(out), "--max_steps", "1", "--num_sample_generations", "0", *QUIET]
    results = ppo_script.main(argv)
    assert results["global_step"] == 1
    for when in ("before", "after"):
        assert -1.0 <= results[when]["eval_objective/scores/true_reward"] <= 1.0
    assert '"global_step": 1' in capsys.readouterr().out  # the metrics are printed too
    policy = AutoModelForCausalLM.from_pretrained(out)
    initial = _weights(kit.load_model("llama-sft"))
    assert not torch.equal(policy.model.embed_tokens.weight, initial["model.embed_tokens.weight"])
    assert (out / "value_model" / "config.json").is_file()


def test_reward_command_trains_on_a_local_preference_file(kit, tmp_path, capsys):
    pairs = tmp_path / "pairs.jsonl"
    kit.preference_dataset("train", n=64).to_json(str(pairs))
    out, results_file = tmp_path / "rm", tmp_path / "results.json"
    argv = ["reward", "--model_name_or_path", str(kit.model_path("llama-sft")), "--dataset_name", str(pairs)]
    argv += ["--output_dir", str(out), "--max_steps", "4", "--per_device_train_batch_size", "16"]
    argv += ["--learning_rate", "3e-3", "--max_length", "64", "--results_file", str(results_file), *QUIET]
    code = main(argv)
    assert code == 0
    metrics = json.loads(results_file.read_text())
    assert (metrics["global_step"], metrics["world_size"]) == (4, 1)
    assert (metrics["preprocessing"]["train"]["num_rows"], metrics["preprocessing"]["train"]["num_kept"]) == (
        64,
        64,
    )
    assert results_file.read_text() in capsys.readouterr().out  # printed as well
    model, _ = load_reward_model(str(out))
    assert model.config.num_labels == 1
    backbone = _weights(kit.load_model("llama-sft"))["model.embed_tokens.weight"]
    assert not torch.equal(model.model.embed_tokens.weight, backbone)


def test_package_import_stays_light():
    code = (
        "import sys, rlhf_trainers.cli, rlhf_trainers.scripts._common, rlhf_trainers.scripts.ppo, "
        "rlhf_trainers.scripts.rloo, rlhf_trainers.scripts.reward, rlhf_trainers.scripts.grpo; "
        "print(','.join(m for m in ('transformers', 'datasets', 'accelerate', 'peft', 'deepspeed') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == ""


def test_grpo_command_learns_on_the_kit_in_optimizer_steps(tmp_path):
    """``rlhf-trainers grpo`` on the kit: its defaults learn, and max_steps counts optimizer steps (4 per
    generation with the kit defaults: num_iterations 2 x steps_per_generation 2)."""
    results = main_grpo(["--output_dir", str(tmp_path / "grpo"), "--max_steps", "32", *QUIET])
    assert results["global_step"] == 32
    assert results["after"]["eval_objective/scores"] - results["before"]["eval_objective/scores"] > 0.2
    assert (tmp_path / "grpo" / "model.safetensors").is_file()


def main_grpo(argv: list[str]) -> dict:
    from rlhf_trainers.scripts.grpo import main as grpo_main

    return grpo_main(argv)
