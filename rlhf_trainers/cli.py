"""The ``rlhf-trainers`` command.

``rlhf-trainers demo``    the offline end-to-end demo (see :mod:`rlhf_trainers.demo`)
``rlhf-trainers reward``  train a reward model (:mod:`rlhf_trainers.scripts.reward`)
``rlhf-trainers ppo``     train a policy with PPO (:mod:`rlhf_trainers.scripts.ppo`)
``rlhf-trainers rloo``    train a policy with RLOO (:mod:`rlhf_trainers.scripts.rloo`)
``rlhf-trainers grpo``    train a policy with GRPO (:mod:`rlhf_trainers.scripts.grpo`)
``rlhf-trainers kit``     build the offline kit (or find it in the cache) and print where its assets are
``rlhf-trainers vllm-serve``  start vLLM's server for training with ``vllm_mode="server"``
                          (:mod:`rlhf_trainers.scripts.vllm_serve`)

Each sub-command parses its own flags from dataclasses with ``transformers.HfArgumentParser``, so
``rlhf-trainers ppo --help`` documents every field (every ``PPOConfig`` field is a flag). The trainer
sub-commands run under ``accelerate launch`` too: ``accelerate launch -m rlhf_trainers.cli ppo ...``
(see docs/cli.md).
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

_COMMANDS = {
    "demo": "offline end-to-end RLHF demo on CPU (builds the offline kit, trains, reports)",
    "reward": "train a reward model on preference pairs (RewardTrainer; every RewardConfig field is a flag)",
    "ppo": "train a policy with PPO (PPOTrainer; every PPOConfig field is a flag)",
    "rloo": "train a policy with RLOO (RLOOTrainer; every RLOOConfig field is a flag)",
    "grpo": "train a policy with GRPO (GRPOTrainer, TRL's names; every GRPOConfig field is a flag)",
    "kit": "build the offline kit (tokenizer, tiny models, synthetic task) and print its paths",
    "vllm-serve": "start vLLM's server for a model, ready for training with vllm_mode='server'",
}

#: The trainer sub-commands, each run by the module of the same name in rlhf_trainers.scripts.
_TRAINER_COMMANDS = ("reward", "ppo", "rloo", "grpo")


@dataclass
class KitArguments:
    """Flags of ``rlhf-trainers kit``."""

    kit_dir: str | None = field(
        default=None,
        metadata={
            "help": "Folder to build the kit in (default: $RLHF_TRAINERS_KIT_DIR, else ~/.cache/rlhf_trainers/kit-<version>)."
        },
    )


def _usage() -> str:
    lines = ["usage: rlhf-trainers {" + ",".join(_COMMANDS) + "} [--help] [flags]", "", "commands:"]
    lines += [f"  {name:<10} {text}" for name, text in _COMMANDS.items()]
    lines += ["", "Run `rlhf-trainers COMMAND --help` for the flags of a command."]
    lines += [
        "Under accelerate: `accelerate launch [--config_file ...] -m rlhf_trainers.cli COMMAND [flags]`."
    ]
    return "\n".join(lines)


def _parse(parser: Any, args: list[str]) -> tuple[Any, ...]:
    """`args` parsed into the parser's dataclasses; a bad flag (unknown, or a value of the wrong type or
    refused) prints its error first, with a pointer to ``--help``, not the whole usage, and exits with
    status 2."""
    from .scripts._common import as_flags, exit_with_error, unknown_arguments_message

    parser.error = lambda message: exit_with_error(parser.prog, message)
    _, unknown = parser.parse_known_args(args)
    if unknown:
        parser.error(unknown_arguments_message(parser, unknown))
    try:
        return tuple(parser.parse_args_into_dataclasses(args=args, look_for_args_file=False))
    except ValueError as error:
        dests = [action.dest for action in parser._actions]
        parser.error(as_flags(str(error), dests))
        raise  # pragma: no cover  (parser.error exits)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rlhf-trainers`` console script. Returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help"}:
        print(_usage())
        return 0
    if args[0] == "--version":
        from . import __version__

        print(__version__)
        return 0
    command, rest = args[0], args[1:]
    if command not in _COMMANDS:
        print(f"rlhf-trainers: unknown command {command!r}.\n\n{_usage()}", file=sys.stderr)
        return 2
    if command in _TRAINER_COMMANDS:
        # rlhf_trainers.scripts.<name>.main parses the flags (exit status 2 with a message on a bad one),
        # trains, saves and prints the metrics.
        script = importlib.import_module(f"rlhf_trainers.scripts.{command}")
        script.main(rest, prog=f"rlhf-trainers {command}")
        return 0
    if command == "vllm-serve":
        from .scripts import vllm_serve

        vllm_serve.main(rest)
        return 0

    from transformers import HfArgumentParser
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-model "Loading weights" bars drown the demo's own output
    if command == "demo":
        from .demo import DemoArguments, run_demo

        parser = HfArgumentParser(DemoArguments, prog="rlhf-trainers demo", description=_COMMANDS["demo"])
        (demo_args,) = _parse(parser, rest)
        run_demo(demo_args)
        return 0

    from .testing import get_kit

    parser = HfArgumentParser(KitArguments, prog="rlhf-trainers kit", description=_COMMANDS["kit"])
    (kit_args,) = _parse(parser, rest)
    kit = get_kit(kit_args.kit_dir)
    paths = {
        "root": str(kit.root),
        "tokenizer": str(kit.tokenizer_path),
        "tokenizer-alt": str(kit.alt_tokenizer_path),
    }
    paths.update({name: str(kit.model_path(name)) for name in kit.model_names})
    print(json.dumps(paths, indent=2))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
