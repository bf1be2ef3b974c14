"""The ``rlhf-trainers`` command and the cost of ``import rlhf_trainers`` (the demo: tests/test_demo.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points

from rlhf_trainers import __version__
from rlhf_trainers.cli import main


def test_import_is_fast_and_does_not_pull_in_heavy_libraries():
    code = (
        "import sys, time; t = time.process_time(); import rlhf_trainers; t = time.process_time() - t; "
        "heavy = [m for m in ('transformers', 'datasets', 'accelerate', 'peft', 'deepspeed') if m in sys.modules]; "
        "print(t, ','.join(heavy))"
    )
    # The first run may pay for cold file caches; the budget in the issue is "well under 5 s". CPU time,
    # not wall time: the suite runs on parallel workers, and a busy machine stretches the wall clock
    # (9 s seen under load for an import that takes 1.9 s of CPU).
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


def test_kit_command_prints_existing_paths(kit, capsys):
    assert main(["kit", "--kit_dir", str(kit.root)]) == 0
    paths = json.loads(capsys.readouterr().out)
    assert paths["root"] == str(kit.root)
    assert set(kit.model_names) <= set(paths)
    for path in paths.values():
        assert (kit.root / path).exists(), path
