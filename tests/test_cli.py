"""The ``rlhf-trainers`` command and what ``import rlhf_trainers`` imports (the demo: tests/test_demo.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points

from rlhf_trainers import __version__
from rlhf_trainers.cli import main


def test_import_does_not_pull_in_heavy_libraries():
    # What keeps `import rlhf_trainers` (and `rlhf-trainers --help`) light: the trainers' libraries are
    # imported when a trainer is first used. Its time is for benchmarks, not for this test.
    code = (
        "import sys; import rlhf_trainers; "
        "heavy = [m for m in ('transformers', 'datasets', 'accelerate', 'peft', 'deepspeed') if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    heavy = run.stdout.split()
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
