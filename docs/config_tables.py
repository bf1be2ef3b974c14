"""Write the field tables of docs/ppo.md, docs/grpo.md, docs/cpu.md and docs/coming-from-trl.md from the
dataclasses' metadata (and, for the last, TRL 1.16's fields in tests/data/trl_1_16_fields.json).

    python docs/config_tables.py           # rewrite the tables between the markers
    python docs/config_tables.py --check   # exit 1 if a page is out of date

A table lists the fields a class declares itself (name, default, help). The ``TrainingArguments`` fields
that ``OnPolicyConfig`` re-declares are listed separately with both defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

from transformers import TrainingArguments

import rlhf_trainers.trl_compat as trl_compat
from rlhf_trainers import CPUOptions, GRPOConfig, OnPolicyConfig, PPOConfig, RewardConfig, RLOOConfig

HERE = Path(__file__).resolve().parent
TRL_FIELDS = HERE.parent / "tests" / "data" / "trl_1_16_fields.json"


def _default(f: dataclasses.Field) -> object:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _fmt(value: object) -> str:
    return f"`{value!r}`" if isinstance(value, str) else f"{value}"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _own_fields(cls: type, parent: type | None) -> list[dataclasses.Field]:
    """The fields ``cls`` adds to ``parent``, without TRL's fields of ``rlhf_trainers.trl_compat`` (listed
    on docs/coming-from-trl.md)."""
    inherited = {f.name for f in dataclasses.fields(parent)} if parent is not None else set()
    for mixin in (trl_compat.TRLGenerationFields, trl_compat.TRLGRPOFields, trl_compat.TRLRewardFields):
        if issubclass(cls, mixin):
            inherited |= {f.name for f in dataclasses.fields(mixin)}
    return [f for f in dataclasses.fields(cls) if f.name not in inherited]


def table(cls: type, parent: type | None = None) -> str:
    rows = ["| field | default | meaning |", "|---|---|---|"]
    for f in _own_fields(cls, parent):
        rows.append(f"| `{f.name}` | {_fmt(_default(f))} | {_cell(f.metadata.get('help', ''))} |")
    return "\n".join(rows)


def changed_defaults() -> str:
    """The TrainingArguments fields OnPolicyConfig re-declares (new default, or new help in update units)."""
    base = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    ours = {f.name: f for f in dataclasses.fields(OnPolicyConfig)}
    rows = ["| field | `TrainingArguments` default | ours | meaning |", "|---|---|---|---|"]
    for name in OnPolicyConfig.__annotations__:
        if name in base:
            rows.append(
                f"| `{name}` | {_fmt(_default(base[name]))} | {_fmt(_default(ours[name]))} | "
                f"{_cell(ours[name].metadata.get('help', ''))} |"
            )
    return "\n".join(rows)


def trl_table(cls: type) -> str:
    """TRL 1.16's fields of the class of the same name beside ours: defaults and how each is taken."""
    trl = json.loads(TRL_FIELDS.read_text(encoding="utf-8"))["classes"][cls.__name__]
    ours = {f.name: _default(f) for f in dataclasses.fields(cls)}
    differences = trl_compat.DIFFERENCES[cls.__name__]
    rows = ["| TRL field | TRL default | ours | here |", "|---|---|---|---|"]
    for name, default in trl.items():
        if name in trl_compat.REFUSED:
            how = f"refused unless {_fmt(ours[name])}: {trl_compat.REFUSED[name]}"
        elif name in trl_compat.INERT:
            how = f"accepted, no effect: {trl_compat.INERT[name]}"
        elif name in trl_compat.ALIASES[cls.__name__]:
            how = f"same meaning; sets {trl_compat.ALIASES[cls.__name__][name]}"
        else:
            how = "same meaning"
        if name in differences:
            how += f"; default differs: {differences[name]}"
        elif how == "same meaning":
            how = "same"
        rows.append(f"| `{name}` | {_fmt(default)} | {_fmt(ours.get(name, '(missing)'))} | {_cell(how)} |")
    return "\n".join(rows)


def pages() -> dict[Path, dict[str, str]]:
    """Each page's marked blocks and their tables."""
    return {
        HERE / "ppo.md": {
            "onpolicy-defaults": changed_defaults(),
            "onpolicy-fields": table(OnPolicyConfig, TrainingArguments),
            "ppo-fields": table(PPOConfig, OnPolicyConfig),
        },
        HERE / "grpo.md": {"grpo-fields": table(GRPOConfig, OnPolicyConfig)},
        HERE / "cpu.md": {"cpu-fields": table(CPUOptions)},
        HERE / "coming-from-trl.md": {
            "trl-grpo-fields": trl_table(GRPOConfig),
            "trl-rloo-fields": trl_table(RLOOConfig),
            "trl-reward-fields": trl_table(RewardConfig),
        },
    }


def render(text: str, blocks: dict[str, str], doc: Path) -> str:
    for name, body in blocks.items():
        pattern = re.compile(rf"(<!-- {name}:start -->\n).*?(<!-- {name}:end -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"{doc}: marker <!-- {name}:start --> ... <!-- {name}:end --> not found")
        text = pattern.sub(lambda m, body=body: m.group(1) + body + "\n" + m.group(2), text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a page is out of date")
    args = parser.parse_args()
    stale = []
    for doc, blocks in pages().items():
        text = doc.read_text()
        new = render(text, blocks, doc)
        if new != text:
            if args.check:
                stale.append(doc)
            else:
                doc.write_text(new)
    if stale:
        for doc in stale:
            print(f"{doc} is out of date: run python docs/config_tables.py", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
