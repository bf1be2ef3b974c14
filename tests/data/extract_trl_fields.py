"""Write tests/data/trl_1_16_fields.json: the fields TRL's GRPOConfig, RLOOConfig and RewardConfig add to
``transformers.TrainingArguments``, and the ``TrainingArguments`` defaults they override, with their
defaults. Run it with the Python of an environment where TRL is installed (the benchmarks' venv):

    benchmarks/.venvs/trl-latest/bin/python tests/data/extract_trl_fields.py

tests/test_trl_compat_fields.py compares our configs with the file, so TRL itself is not needed there.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import transformers
import trl
from transformers import TrainingArguments

OUT = Path(__file__).resolve().parent / "trl_1_16_fields.json"
CLASSES = ("GRPOConfig", "RLOOConfig", "RewardConfig")


def _default(f: dataclasses.Field) -> object:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "<required>"
    if isinstance(value, tuple):
        return list(value)
    json.dumps(value)  # the defaults are plain values; anything else should fail loudly here
    return value


def fields_of(cls: type) -> dict[str, object]:
    """``cls``'s fields that TrainingArguments lacks, or whose default differs from TrainingArguments'."""
    base = {f.name: _default(f) for f in dataclasses.fields(TrainingArguments)}
    out = {}
    for f in dataclasses.fields(cls):
        value = _default(f)
        if f.name not in base or base[f.name] != value:
            out[f.name] = value
    return out


def main() -> None:
    data = {
        "_header": (
            "Written by tests/data/extract_trl_fields.py (run in an environment with TRL installed): for each "
            "TRL config class, the fields it adds to transformers.TrainingArguments and the TrainingArguments "
            "fields whose default it overrides, with TRL's default. Compared with our configs by "
            "tests/test_trl_compat_fields.py."
        ),
        "trl_version": trl.__version__,
        "transformers_version": transformers.__version__,
        "classes": {name: fields_of(getattr(trl, name)) for name in CLASSES},
    }
    OUT.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    counts = ", ".join(f"{k} {len(v)}" for k, v in data["classes"].items())
    print(f"wrote {OUT} (TRL {trl.__version__}: {counts})", file=sys.stderr)


if __name__ == "__main__":
    main()
