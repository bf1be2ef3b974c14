"""The ``rlhf-trainers`` command, the foundation demo, and the cost of ``import rlhf_trainers``."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from rlhf_trainers import __version__
from rlhf_trainers.cli import main
from rlhf_trainers.demo import DemoArguments


def test_import_is_fast_and_does_not_pull_in_heavy_libraries():
    code = (
        "import sys, time; t = time.perf_counter(); import rlhf_trainers; t = time.perf_counter() - t; "
        "heavy = [m for m in ('transformers', 'datasets', 'accelerate', 'peft', 'deepspeed') if m in sys.modules]; "
        "print(t, ','.join(heavy))"
    )
    # The first run may pay for cold file caches; the budget in the issue is "well under 5 s".
    runs = [
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        for _ in range(2)
    ]
    seconds, heavy = runs[-1].stdout.split()[0], runs[-1].stdout.split()[1:]
    assert float(seconds) < 4.0, runs[-1].stdout
    assert heavy == [], f"import rlhf_trainers imported {heavy}"


def test_console_script_is_registered():
    scripts = {ep.name: ep.value for ep in entry_points(group="console_scripts")}
    assert scripts.get("rlhf-trainers") == "rlhf_trainers.cli:main"


def test_help_version_and_unknown_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "demo" in out and "kit" in out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == __version__
    assert main(["nonsense"]) == 2
    assert "unknown command 'nonsense'" in capsys.readouterr().err


def test_demo_help_documents_every_field(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for name in DemoArguments.__dataclass_fields__:
        assert f"--{name}" in out, name


def test_kit_command_prints_existing_paths(kit, capsys):
    assert main(["kit", "--kit_dir", str(kit.root)]) == 0
    paths = json.loads(capsys.readouterr().out)
    assert paths["root"] == str(kit.root)
    assert set(kit.model_names) <= set(paths)
    for path in paths.values():
        assert (kit.root / path).exists(), path


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rloo_k": 1}, "rloo_k=1"),
        ({"response_length": 0}, "response_length=0"),
        ({"temperature": 0.0}, "temperature=0.0"),
    ],
)
def test_demo_arguments_reject_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DemoArguments(**kwargs)


def test_demo_raises_the_hidden_true_reward(kit, tmp_path, capsys):
    out = tmp_path / "report"
    code = main(
        [
            "demo",
            "--num_updates",
            "20",
            "--eval_prompts",
            "48",
            "--kit_dir",
            str(kit.root),
            "--output_dir",
            str(out),
        ]
    )
    assert code == 0
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["true_reward_gain"] >= 0.3, summary["true_reward_gain"]
    assert summary["true_reward_after"] == pytest.approx(
        summary["true_reward_before"] + summary["true_reward_gain"]
    )
    assert len(summary["history"]) == 20
    assert summary["history"][-1]["episodes"] == 20 * 16 * 4
    assert "before" in capsys.readouterr().out
