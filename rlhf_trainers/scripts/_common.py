"""What the training scripts share: argument dataclasses, command-line parsing (the offline kit's
defaults, clear errors for bad flags), dataset loading from the Hub, a folder or a file, the LoRA config,
and the PPO/RLOO run from parsed arguments to a saved model.

Nothing here is imported by ``import rlhf_trainers``; ``transformers``/``datasets``/``peft`` are imported
inside the functions that need them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import json
import logging
import re
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:  # pragma: no cover
    import datasets
    from peft import LoraConfig
    from transformers import HfArgumentParser, PreTrainedTokenizerBase, Trainer

    from ..cpu import CPUOptions
    from ..onpolicy import OnPolicyConfig, OnPolicyTrainer

logger = logging.getLogger(__name__)

#: File suffixes ``--dataset_name`` accepts for a single data file, and the ``datasets`` builder of each.
DATA_FILE_BUILDERS = {"json": "json", "jsonl": "json", "csv": "csv", "parquet": "parquet"}
#: ``--dataset_test_split`` values that turn evaluation off.
NO_SPLIT = frozenset({"", "none", "null", "no"})
#: The offline kit's policy, used when no ``--model_name_or_path`` is given.
KIT_MODEL = "llama-sft"


@dataclass
class DatasetArguments:
    """Which dataset to train and evaluate on. Left empty, the offline kit's synthetic data is used."""

    _argument_group_name = "dataset"

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "The dataset: a Hub id (e.g. trl-lib/tldr), a folder written by Dataset.save_to_disk or "
            "DatasetDict.save_to_disk, a folder of data files, or one .json/.jsonl/.csv/.parquet file (it "
            "becomes the train split). Default: the offline kit's synthetic data (prompts for ppo and "
            "rloo, preference pairs for reward)."
        },
    )
    dataset_config: str | None = field(
        default=None,
        metadata={"help": "Configuration (subset) of a Hub dataset: the second argument of load_dataset."},
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str | None = field(
        default="test",
        metadata={
            "help": "Split to evaluate on. No evaluation when the dataset has no such split, or with 'none'."
        },
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Use only the first N rows of the train split."}
    )
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Evaluate on only the first N rows of the test split."}
    )

    def __post_init__(self) -> None:
        for name in ("max_train_samples", "max_eval_samples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(
                    f"--{name} {value}: expected a positive number of rows, or leave it unset for all."
                )
        if self.dataset_test_split is not None and self.dataset_test_split.strip().lower() in NO_SPLIT:
            self.dataset_test_split = None


@dataclass
class LoraArguments:
    """Train a LoRA adapter (PEFT) instead of every weight."""

    _argument_group_name = "LoRA (PEFT)"

    use_peft: bool = field(
        default=False,
        metadata={
            "help": "Train a LoRA adapter instead of all weights. The reward model's score head is trained "
            "in full; for ppo and rloo the reference policy is the same weights with the adapter disabled."
        },
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (the update is scaled by alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA input."})
    lora_target_modules: str = field(
        default="all-linear",
        metadata={
            "help": "Modules that get an adapter: 'all-linear' (every linear layer but the output head) or a "
            "comma-separated list of module names, e.g. q_proj,v_proj,lm_head."
        },
    )

    def __post_init__(self) -> None:
        if self.lora_r < 1:
            raise ValueError(
                f"--lora_r {self.lora_r}: the LoRA rank must be at least 1 (16 is a common value)."
            )
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"--lora_dropout {self.lora_dropout}: expected a probability in [0, 1).")
        if not self.lora_target_modules.strip(" ,"):
            raise ValueError(
                "--lora_target_modules is empty: give 'all-linear' or module names, e.g. q_proj,v_proj."
            )

    def target_modules(self) -> str | list[str]:
        """``lora_target_modules`` as peft takes it: 'all-linear' (or one name) as is, a list otherwise."""
        value = self.lora_target_modules
        return [m.strip() for m in value.split(",") if m.strip()] if "," in value else value.strip()

    def peft_config(self, task_type: str) -> LoraConfig | None:
        """The ``LoraConfig`` of these flags (None without ``--use_peft``); `task_type` is peft's, e.g.
        "CAUSAL_LM" for a policy or "SEQ_CLS" for a reward model."""
        if not self.use_peft:
            return None
        from ..models import require_peft

        require_peft("--use_peft")
        from peft import LoraConfig

        return LoraConfig(
            r=self.lora_r,
            lora_alpha=self.lora_alpha,
            lora_dropout=self.lora_dropout,
            target_modules=self.target_modules(),
            task_type=task_type,
        )


@dataclass
class OnPolicyScriptArguments:
    """The models and reward sources of a PPO or RLOO run. Left empty, the offline kit's tiny SFT model is
    the policy and its hidden sentiment rule (``rlhf_trainers.testing.true_reward``) the reward."""

    _argument_group_name = "models, rewards and tools"

    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": f"Policy (a causal LM): a local folder or a Hub id. Default: the offline kit's {KIT_MODEL}."
        },
    )
    reward_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Reward model (a one-label sequence-classification model, e.g. saved by `rlhf-trainers "
            "reward`): a local folder or a Hub id. Its own tokenizer is used when its folder has one. "
            "None: the reward function true_reward only."
        },
    )
    use_true_reward: bool | None = field(
        default=None,
        metadata={
            "help": "Also score with rlhf_trainers.testing.true_reward (the kit's hidden sentiment rule). "
            "Default: only when there is no reward model. With a reward model, --reward_weights 1.0 0.0 "
            "logs it without training on it."
        },
    )
    prompt_column: str = field(
        default="prompt",
        metadata={
            "help": "Column holding the prompts (text or chat messages), renamed to 'prompt'. A 'messages' "
            "or 'input_ids' column is used when there is no 'prompt' column. The other columns are passed "
            "to reward functions."
        },
    )
    eval_before_training: bool = field(
        default=True, metadata={"help": "Evaluate once before training (needs a test split)."}
    )
    tools: list[str] | None = field(
        default=None,
        metadata={
            "help": "Tools the policy may call (multi-turn rollouts, docs/agents.md): functions with type "
            "hints and a Google-style docstring, named as module:function, module.function or "
            "path/to/file.py:function, separated by spaces or commas. They are imported before any model "
            "loads. See --max_tool_calling_iterations and --tool_timeout."
        },
    )
    tool_chat_template: str = field(
        default="auto",
        metadata={
            "help": "Chat template of a run with --tools: 'auto' keeps the tokenizer's own when it can hold a "
            "tool-calling conversation and installs rlhf_trainers' tool-capable one otherwise (with a note); "
            "'ours' always installs ours; 'model' always keeps the tokenizer's own (refused when it cannot "
            "hold tool calls). The tokenizer is saved with the template used.",
            "choices": ["auto", "ours", "model"],
        },
    )
    results_file: str | None = field(
        default=None,
        metadata={
            "help": "Write the metrics (eval before and after training, training) as JSON here (main process). "
            "Default: <output_dir>/results.json, unless --disable_tqdm true, which prints the JSON instead."
        },
    )

    def trainer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the trainer that only one algorithm has (PPO's value model)."""
        return {}


# ---- command line -------------------------------------------------------------------------------


def algorithm_classes(name: str) -> tuple[type, type]:
    """The config and trainer classes of ``name`` (``"ppo"``, ``"rloo"`` or ``"grpo"``), imported on demand
    (the examples choose one from a flag before parsing the rest)."""
    import rlhf_trainers

    if name not in ("ppo", "rloo", "grpo"):
        raise ValueError(f"algorithm {name!r}: expected 'ppo', 'rloo' or 'grpo'.")
    upper = name.upper()
    return getattr(rlhf_trainers, f"{upper}Config"), getattr(rlhf_trainers, f"{upper}Trainer")


def flag_given(name: str, args: Sequence[str]) -> bool:
    """Whether ``--name`` (or ``--name-with-dashes``) is on the command line `args`, with or without ``=``."""
    spellings = {f"--{name}", f"--{name.replace('_', '-')}"}
    return any(arg.split("=", 1)[0] in spellings for arg in args)


def unknown_arguments_message(parser: HfArgumentParser, unknown: Sequence[str]) -> str:
    """The error for the `unknown` arguments ``parse_known_args`` left: each unknown flag with the close
    matches among `parser`'s flags, and each value that follows no flag."""
    # Suggest each flag in its first spelling (--learning_rate), not its dashed alias too.
    options = [action.option_strings[0] for action in parser._actions if action.option_strings]
    problems, after_flag = [], False
    for arg in unknown:
        if arg.startswith("-"):
            name = arg.split("=", 1)[0]
            close = difflib.get_close_matches(name, options, n=3, cutoff=0.75)
            problems.append(f"{name} (did you mean {' or '.join(close)}?)" if close else name)
            after_flag = "=" not in arg
        elif not after_flag:
            problems.append(
                f"the value {arg!r}, which follows no flag (a flag takes one value unless --help says it takes several)"
            )
        else:
            after_flag = False
    return f"unknown flag(s): {', '.join(problems)}."


def exit_with_error(prog: str | None, message: str) -> NoReturn:
    """Print `message` as the command's error, first and alone (no usage dump), with a pointer to
    ``--help``, and exit with status 2 (argparse's status for a usage error)."""
    prog = prog or Path(sys.argv[0]).name
    sys.stderr.write(f"{prog}: error: {message}\nRun `{prog} --help` for the flags.\n")
    raise SystemExit(2)


#: A Python field name written as ``name=``, not inside a call or quotes (``Config(name=``, ``'name=``).
_ASSIGNMENT = re.compile(r"(?<![\w.\-'\"(\[])([A-Za-z_]\w*)=(?!=)")


def as_flags(message: str, flags: Iterable[str]) -> str:
    """`message` with each ``name=value`` of a flag's field written as the command line takes it,
    ``--name value`` (the configs' checks name fields as Python does)."""
    names = set(flags)
    return _ASSIGNMENT.sub(lambda m: f"--{m.group(1)} " if m.group(1) in names else m.group(0), message)


def flag_names(dataclass_types: Sequence[type]) -> set[str]:
    """The fields of `dataclass_types`: the flags of a command that parses them."""
    return {f.name for dtype in dataclass_types for f in dataclasses.fields(dtype)}


def _raised_here(error: BaseException) -> bool:
    """Whether `error` was raised by this package's own code (its last traceback frame is in
    ``rlhf_trainers``): one of its checks, not a library's failure deeper down."""
    package = str(Path(__file__).resolve().parent.parent)
    tb = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return str(Path(tb.tb_frame.f_code.co_filename).resolve()).startswith(package)


@contextlib.contextmanager
def usage_errors(prog: str | None, flags: Iterable[str]) -> Iterator[None]:
    """Inside, a ``ValueError`` (or ``FileNotFoundError``) raised by this package's checks (a config, a
    model path, a dataset, a trainer's construction) exits as a bad flag does: its message only, fields
    written as flags (:func:`as_flags`), no traceback. Errors raised elsewhere propagate unchanged."""
    try:
        yield
    except (ValueError, FileNotFoundError) as error:
        if not _raised_here(error):
            raise
        exit_with_error(prog, as_flags(str(error), flags))


def _group_config_flags(parser: argparse.ArgumentParser, dataclass_types: Sequence[type]) -> None:
    """List a ``TrainingArguments`` subclass's own flags in ``--help`` before the ~100 it inherits.

    ``HfArgumentParser`` adds a dataclass's fields in definition order, so a config's own fields (the
    trainer's: ``kl_coef``, ``rloo_k``...) came after every ``TrainingArguments`` field, some 700 lines
    into the help. This moves each flag into one of two titled groups (what ``--help`` prints; parsing is
    unchanged): the config's own fields first, then the inherited ones.
    """
    from transformers import TrainingArguments

    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    for dtype in dataclass_types:
        if not (isinstance(dtype, type) and issubclass(dtype, TrainingArguments)):
            continue
        own = {f.name for f in dataclasses.fields(dtype)} - inherited
        groups = (
            (parser.add_argument_group(f"{dtype.__name__} (this trainer's settings)"), own),
            (parser.add_argument_group("transformers.TrainingArguments (inherited)"), inherited),
        )
        for action in list(parser._optionals._group_actions):
            for group, names in groups:
                if action.dest in names:
                    parser._optionals._group_actions.remove(action)
                    group._group_actions.append(action)
                    break
    _list_cpu_options_last(parser)


def _list_cpu_options_last(parser: argparse.ArgumentParser) -> None:
    """Move the CPU speed switches' group (:class:`~rlhf_trainers.CPUOptions`) to the end of ``--help``:
    after the algorithm's options, which are what most users look for (a GPU run needs none of them)."""
    from ..cpu import CPUOptions

    title = CPUOptions._argument_group_name
    groups = [group for group in parser._action_groups if group.title == title]
    for group in groups:
        parser._action_groups.remove(group)
        parser._action_groups.append(group)


def parse_args(
    dataclass_types: Sequence[type],
    argv: Sequence[str] | None = None,
    *,
    prog: str | None = None,
    description: str | None = None,
    kit_defaults: Mapping[str, Any] | None = None,
) -> tuple[Any, ...]:
    """Parse `argv` (default ``sys.argv[1:]``) into one instance of each of `dataclass_types`.

    Every field is a flag (``HfArgumentParser``); ``--help`` lists them with their help text. When
    `kit_defaults` is given and the command line has no ``--model_name_or_path`` (the run is on the
    offline kit), each of its ``field: value`` pairs replaces the config's default unless that flag is
    given. An unknown flag, a value of the wrong type or a value the config rejects exits with status 2
    and a message that names it (:func:`exit_with_error`: the error first, no usage dump), not with a
    traceback. A config's problems are listed all at once, their fields written as flags.
    """
    from transformers import HfArgumentParser

    args = list(sys.argv[1:] if argv is None else argv)
    epilog = None
    if kit_defaults:
        given = " ".join(f"--{name} {value}" for name, value in kit_defaults.items())
        epilog = (
            "On the offline kit (no --model_name_or_path), these settings replace the config's defaults "
            f"unless the flag is given: {given}."
        )
    # allow_abbrev=False: an abbreviated or misspelled flag is an error rather than whichever field it
    # happens to be a prefix of today.
    parser = HfArgumentParser(
        dataclass_types, prog=prog, description=description, epilog=epilog, allow_abbrev=False
    )
    _group_config_flags(parser, dataclass_types)
    parser.error = lambda message: exit_with_error(parser.prog, message)  # type: ignore[method-assign]
    wants_help = "-h" in args or "--help" in args
    if kit_defaults and not wants_help and not flag_given("model_name_or_path", args):
        args = [
            f"--{name}={value}" for name, value in kit_defaults.items() if not flag_given(name, args)
        ] + args
    _, unknown = parser.parse_known_args(args)
    if unknown:
        parser.error(unknown_arguments_message(parser, unknown))
    try:
        return tuple(parser.parse_args_into_dataclasses(args=args, look_for_args_file=False))
    except ValueError as error:  # a config's __post_init__ rejected a value: a usage error, not a crash
        parser.error(as_flags(str(error), flag_names(dataclass_types)))
        raise  # pragma: no cover  (parser.error exits)


# ---- data ---------------------------------------------------------------------------------------


def load_splits(args: DatasetArguments) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """(train, test or None) of ``--dataset_name``: a data file, a ``save_to_disk`` folder, a folder of
    data files or a Hub id, cut to ``--max_train_samples`` / ``--max_eval_samples``."""
    import datasets

    if args.dataset_name is None:
        raise ValueError("load_splits needs --dataset_name; without it the offline kit's data is used.")
    name = args.dataset_name
    path = Path(name).expanduser()
    suffix = path.suffix.lower().lstrip(".")
    splits: Mapping[str, datasets.Dataset]
    if path.is_file():
        if suffix not in DATA_FILE_BUILDERS:
            raise ValueError(
                f"--dataset_name {name}: a file ending in {path.suffix or '(no suffix)'}; a data file must end "
                f"in one of {', '.join('.' + s for s in DATA_FILE_BUILDERS)}. Rename it, or give a folder or a "
                "Hub dataset id."
            )
        splits = {
            args.dataset_train_split: datasets.load_dataset(
                DATA_FILE_BUILDERS[suffix], data_files=str(path), split="train"
            )
        }
    elif path.is_dir() and (path / "dataset_dict.json").is_file():
        splits = datasets.load_from_disk(str(path))
    elif path.is_dir() and (path / "state.json").is_file():
        splits = {args.dataset_train_split: datasets.load_from_disk(str(path))}
    elif not path.exists() and (suffix in DATA_FILE_BUILDERS or name.startswith(("/", "./", "../", "~"))):
        raise FileNotFoundError(
            f"--dataset_name {name}: no such file or folder ({path.absolute()}). Give an existing "
            ".json/.jsonl/.csv/.parquet file, a dataset folder, or a Hub dataset id."
        )
    else:  # a Hub id, or a folder of data files (load_dataset finds and reads them)
        splits = datasets.load_dataset(name, args.dataset_config)

    if args.dataset_train_split not in splits:
        raise ValueError(
            f"--dataset_name {name} has no split {args.dataset_train_split!r}; its splits are "
            f"{sorted(splits)}. Choose one with --dataset_train_split."
        )
    train = splits[args.dataset_train_split]
    test = None
    if args.dataset_test_split is not None:
        if args.dataset_test_split in splits:
            test = splits[args.dataset_test_split]
        else:
            logger.warning(
                "%s has no split %r (splits: %s): no evaluation. Name one with --dataset_test_split.",
                name,
                args.dataset_test_split,
                sorted(splits),
            )
    return head(train, args.max_train_samples), head(test, args.max_eval_samples)


def head(data: datasets.Dataset | None, n: int | None) -> datasets.Dataset | None:
    """The first `n` rows of `data` (all of them when `n` is None or larger; None stays None)."""
    if data is None or n is None or n >= len(data):
        return data
    return data.select(range(n))


def kit_model_path(name: str = KIT_MODEL) -> str:
    """The folder of the offline kit's model `name` (the kit is built on first use, see docs/testing-kit.md)."""
    from ..testing import get_kit

    return str(get_kit().model_path(name))


def load_train_test(
    data: DatasetArguments, kit_data: str
) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """(train, test or None): ``--dataset_name``'s splits (:func:`load_splits`), or without it the offline
    kit's train and test splits of `kit_data` ("prompts" or "preferences"), cut to ``--max_*_samples``."""
    if data.dataset_name is not None:
        return load_splits(data)
    from ..testing import get_kit

    kit = get_kit()
    make = {"prompts": kit.prompt_dataset, "preferences": kit.preference_dataset}[kit_data]
    return head(make("train"), data.max_train_samples), head(make("test"), data.max_eval_samples)


def load_prompts(
    script: OnPolicyScriptArguments, data: DatasetArguments
) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """(train, test or None) prompt datasets: ``--dataset_name``'s, or the offline kit's, with the prompt
    column renamed to 'prompt'."""
    train, test = load_train_test(data, "prompts")
    prompt_columns = ("prompt", "messages", "input_ids")
    if script.prompt_column == "prompt" and not any(c in train.column_names for c in prompt_columns):
        raise ValueError(
            f"--dataset_name {data.dataset_name}: no prompt column (none of {', '.join(prompt_columns)}); "
            f"its columns are {train.column_names}. Name the column that holds the prompts with "
            f"--prompt_column, e.g. --prompt_column {train.column_names[0] if train.column_names else 'text'}."
        )
    if script.prompt_column != "prompt":
        if script.prompt_column not in train.column_names:
            raise ValueError(
                f"--prompt_column {script.prompt_column}: no such column in {data.dataset_name}; its columns "
                f"are {train.column_names}."
            )
        train = train.rename_column(script.prompt_column, "prompt")
        if test is not None and script.prompt_column in test.column_names:
            test = test.rename_column(script.prompt_column, "prompt")
    return train, test


def load_policy_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """The policy's tokenizer, left-padded, with a pad token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name_or_path, padding_side="left")
    if tokenizer.pad_token is None:
        # Many Hub causal LMs ship without a pad token. The reference implementation pads with a dedicated
        # one (distinct from EOS), which needs new embeddings; reusing EOS is accepted by the trainers (their
        # masks come from lengths, not from pad ids; only val/num_eos_tokens then counts padding too).
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# ---- running ------------------------------------------------------------------------------------


def resume_argument(config: Any) -> str | bool | None:
    """``--resume_from_checkpoint`` for ``Trainer.train``: a checkpoint folder, or 'true'/'last' for the
    newest checkpoint in ``--output_dir``."""
    value = getattr(config, "resume_from_checkpoint", None)
    if isinstance(value, str) and value.strip().lower() in {"true", "last"}:
        return True
    return value or None


def run_info(trainer: Trainer) -> dict[str, Any]:
    """How the run was distributed: ``world_size``, ``distributed_type`` (accelerate's, e.g.
    "DEEPSPEED") and, under DeepSpeed, ``zero_stage``."""
    state = trainer.accelerator.state
    info: dict[str, Any] = {
        "world_size": trainer.accelerator.num_processes,
        "distributed_type": getattr(state.distributed_type, "value", str(state.distributed_type)),
    }
    plugin = getattr(state, "deepspeed_plugin", None)
    if plugin is not None:
        info["zero_stage"] = plugin.zero_stage
    return info


def report(trainer: Trainer, results: dict[str, Any], results_file: str | None) -> None:
    """Write `results` as JSON to `results_file` and print them (main process only). A trainer with a
    progress display (``trainer.display``: the on-policy trainers without ``--disable_tqdm``) prints two
    lines instead, the eval reward before -> after and where the model and the JSON are (`results_file`,
    by default ``<output_dir>/results.json``); otherwise the JSON is printed, as the scripts parse it."""
    if not trainer.accelerator.is_main_process:
        return
    text = json.dumps(results, indent=2)
    if getattr(trainer, "display", None) is None:
        print(text)
    else:
        results_file = results_file or str(Path(trainer.args.output_dir) / "results.json")
        print(_short_report(results, trainer.args.output_dir, results_file))
    if results_file:
        Path(results_file).parent.mkdir(parents=True, exist_ok=True)
        Path(results_file).write_text(text + "\n")


def _short_report(results: dict[str, Any], output_dir: str, results_file: str) -> str:
    """The CLI's last lines under the progress display: the eval reward before -> after, and the paths."""
    key = "eval_objective/scores"
    before, after = results.get("before", {}).get(key), results.get("after", {}).get(key)
    lines = []
    if after is not None:
        change = (
            f"{before:.3g} before -> {after:.3g} after training" if before is not None else f"{after:.3g}"
        )
        lines.append(f"eval reward (objective/scores on the test split): {change}")
    lines.append(f"model saved to {output_dir}; every metric in {results_file}")
    return "\n".join(lines)


def run_onpolicy(
    trainer_class: type[OnPolicyTrainer],
    script: OnPolicyScriptArguments,
    data: DatasetArguments,
    lora: LoraArguments,
    config: OnPolicyConfig,
    cpu_options: CPUOptions | None = None,
) -> dict[str, Any]:
    """Train a PPO or RLOO policy from parsed arguments: load the prompts and the tokenizer, build the
    trainer (plus ``script.trainer_kwargs()``, e.g. PPO's value model), evaluate before and after training
    when there is a test split, save the model to ``--output_dir``.

    Returns:
        :func:`run_info`, ``global_step``, ``train`` (the training metrics) and, with a test split,
        ``before``/``after`` (the eval metrics).
    """
    trainer, test = build_onpolicy_trainer(trainer_class, script, data, lora, config, cpu_options)
    return train_onpolicy(trainer, test, script, config)


def check_model_flags(script: Any, config: Any) -> None:
    """Refuse a ``--*_name_or_path`` flag that names no model folder and no reachable Hub model
    (:func:`~rlhf_trainers.model_paths.check_model_path`), before anything is loaded."""
    from ..model_paths import check_model_paths

    names = ("model_name_or_path", "reward_model_name_or_path", "value_model_name_or_path")
    named = {f"--{name}": getattr(script, name, None) for name in names}
    check_model_paths(named, getattr(config, "model_init_kwargs", None))


def build_onpolicy_trainer(
    trainer_class: type[OnPolicyTrainer],
    script: OnPolicyScriptArguments,
    data: DatasetArguments,
    lora: LoraArguments,
    config: OnPolicyConfig,
    cpu_options: CPUOptions | None = None,
) -> tuple[OnPolicyTrainer, datasets.Dataset | None]:
    """The trainer of :func:`run_onpolicy` (after checking the model flags and loading the prompts) and
    its test split (or None)."""
    from ._tools import load_tools, prepare_tool_tokenizer

    tools = load_tools(script.tools)  # before anything loads: a wrong name fails in a second
    check_model_flags(script, config)
    if script.model_name_or_path is None:
        script.model_name_or_path = kit_model_path()
    train, test = load_prompts(script, data)

    use_true_reward = script.use_true_reward
    if use_true_reward is None:
        use_true_reward = script.reward_model_name_or_path is None
    reward_funcs = None
    if use_true_reward:
        from ..testing import true_reward

        reward_funcs = [true_reward]

    trainer = trainer_class(
        model=script.model_name_or_path,
        reward_model=script.reward_model_name_or_path,
        reward_funcs=reward_funcs,
        args=config,
        processing_class=prepare_tool_tokenizer(
            load_policy_tokenizer(script.model_name_or_path),
            script.tool_chat_template,
            with_tools=tools is not None,
            model_name=script.model_name_or_path,
        ),
        train_dataset=train,
        eval_dataset=test,
        peft_config=lora.peft_config("CAUSAL_LM"),
        cpu_options=cpu_options,
        tools=tools,
        **script.trainer_kwargs(),
    )
    return trainer, test


def train_onpolicy(
    trainer: OnPolicyTrainer, test: datasets.Dataset | None, script: OnPolicyScriptArguments, config: Any
) -> dict[str, Any]:
    """The rest of :func:`run_onpolicy`: evaluate, train, evaluate, save and report."""
    results = run_info(trainer)
    if test is not None and script.eval_before_training:
        results["before"] = trainer.evaluate()
    results["train"] = trainer.train(resume_from_checkpoint=resume_argument(config)).metrics
    if test is not None:
        results["after"] = trainer.evaluate()
    results["global_step"] = trainer.state.global_step
    trainer.save_model(config.output_dir)
    report(trainer, results, script.results_file)
    return results


def onpolicy_main(
    script_class: type[OnPolicyScriptArguments],
    config_class: type[OnPolicyConfig],
    trainer_class: type[OnPolicyTrainer],
    argv: Sequence[str] | None,
    *,
    prog: str | None,
    description: str,
    kit_defaults: Mapping[str, Any],
) -> dict[str, Any]:
    """The ``main`` of ``rlhf-trainers ppo``, ``rloo`` and ``grpo``: parse `argv` into `script_class`, the
    dataset and LoRA flags, `config_class` and the CPU switches (:class:`~rlhf_trainers.CPUOptions`), then
    :func:`run_onpolicy` with `trainer_class`."""
    from ..cpu import CPUOptions

    # The config is built before any model is loaded: under ZeRO-3 the models are then partitioned on load.
    types = (script_class, DatasetArguments, LoraArguments, config_class, CPUOptions)
    script, data, lora, config, cpu_options = parse_args(
        types, argv, prog=prog, description=description, kit_defaults=kit_defaults
    )
    # A bad model path, dataset or setting found while building the trainer is a usage error too.
    with usage_errors(prog, flag_names(types)):
        trainer, test = build_onpolicy_trainer(trainer_class, script, data, lora, config, cpu_options)
    return train_onpolicy(trainer, test, script, config)
