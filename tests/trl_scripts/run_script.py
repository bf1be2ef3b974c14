"""Run one of TRL's documented scripts of this folder with our trainers, or (``--trl``) with TRL's.

``--trl`` rewrites the script's ``from rlhf_trainers ...`` import lines into ``from trl ...`` and
checks that nothing else changed, so both sides run the same text but for the import. The script runs
as ``__main__``; every ``transformers.Trainer`` it builds gets a timing callback (the wall-clock time of
each optimizer step, generation included), and at exit the log history of the last trainer, the step
times and the script's ``metrics`` variable (if any) are written as JSON to ``--log``.

    TRL_SCRIPTS_MODEL=/path/to/model python tests/trl_scripts/run_script.py grpo_quickstart.py --log out.json

Imports nothing of rlhf_trainers itself, so TRL's environment runs it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
_IMPORT = re.compile(r"^from rlhf_trainers(\.[\w.]+)? import ", re.MULTILINE)


def as_trl(text: str) -> str:
    """`text` with its ``from rlhf_trainers[.x] import`` lines turned into ``from trl[.x] import``.

    Raises:
        ValueError: the script imports rlhf_trainers in another way (so more than the import would
            differ between the two runs), or not at all.
    """
    out, count = _IMPORT.subn(lambda m: f"from trl{m.group(1) or ''} import ", text)
    if count == 0 or "rlhf_trainers" in out:
        raise ValueError(
            "the script must import rlhf_trainers only by `from rlhf_trainers[.x] import ...` lines"
        )
    return out


def _install_timer(records: dict[str, Any]) -> None:
    """Every Trainer built from now on reports its step end times into `records` (and is kept there)."""
    import transformers

    class _StepTimer(transformers.TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            records["step_ends"] = [time.perf_counter()]

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            records["step_ends"].append(time.perf_counter())

    original = transformers.Trainer.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.add_callback(_StepTimer())
        records["trainer"] = self

    transformers.Trainer.__init__ = init


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("script", help="a script of tests/trl_scripts (name or path)")
    parser.add_argument("--trl", action="store_true", help="run it with TRL's trainers (import changed)")
    parser.add_argument("--log", required=True, help="JSON file for the log history and step times")
    args = parser.parse_args(argv)
    path = Path(args.script)
    if not path.is_file():
        path = HERE / args.script
    text = path.read_text()
    if args.trl:
        text = as_trl(text)
    sys.path.insert(0, str(HERE))
    records: dict[str, Any] = {}
    began = time.perf_counter()
    _install_timer(records)
    namespace: dict[str, Any] = {"__name__": "__main__", "__file__": str(path)}
    exec(compile(text, str(path), "exec"), namespace)
    wall = time.perf_counter() - began
    trainer = records.get("trainer")
    ends = records.get("step_ends", [])
    out = {
        "script": path.name,
        "lib": "trl" if args.trl else "rlhf_trainers",
        "wall_s": wall,
        "step_s": [b - a for a, b in itertools.pairwise(ends)],
        "global_step": trainer.state.global_step if trainer is not None else None,
        "log_history": trainer.state.log_history if trainer is not None else [],
        "metrics": _jsonable(namespace.get("metrics")),
    }
    Path(args.log).write_text(json.dumps(out, indent=1, default=repr))


if __name__ == "__main__":
    main()
