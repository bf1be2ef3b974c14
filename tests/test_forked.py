"""``tests/forked.py``: a script run from the preloaded fork server behaves as in a fresh process (what
the docs-page and reliability tests rely on)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import forked
import pytest

SCRIPT = """
import atexit, json, os, sys
mode = sys.argv[1]
atexit.register(lambda: print("atexit ran", flush=True))
print(json.dumps({
    "argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("FORKED_TEST"), "name": __name__,
    "path0": sys.path[0], "path_rest": sys.path[1:], "hub_offline": __import__("huggingface_hub.constants").constants.HF_HUB_OFFLINE,
    "torch_loaded": "torch" in sys.modules, "has_torch_name": "torch" in globals(),
}), flush=True)
print("to stderr", file=sys.stderr)
if mode == "exit":
    sys.exit(3)
if mode == "raise":
    raise RuntimeError("the reason")
if mode == "kill":
    os.kill(os.getpid(), 9)
if mode == "hang":
    import time
    time.sleep(60)
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "bin" / "probe.py"
    path.parent.mkdir()
    path.write_text(SCRIPT)
    return path


def test_a_script_runs_as_main_with_its_argv_cwd_env_and_path(script, tmp_path):
    # PYTHONPATH of the run's environment (an absolute and a relative entry) comes first, as in a fresh
    # interpreter (the launches of tests/distributed.py put tests/ there)
    env = {**os.environ, "FORKED_TEST": "yes", "PYTHONPATH": os.pathsep.join([str(tmp_path / "lib"), "rel"])}
    done = forked.run(script, ["ok", 7], cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[0])
    assert seen["argv"] == [str(script), "ok", "7"] and seen["name"] == "__main__"
    assert seen["cwd"] == str(tmp_path) and seen["env"] == "yes"
    assert seen["path0"] == str(script.parent)
    # preloaded, yet not in the script's namespace: a missing import still fails
    assert seen["torch_loaded"] and not seen["has_torch_name"]
    assert done.stdout.splitlines()[-1] == "atexit ran"
    # the Hub is off for every forked script (read once, at the server's imports), whatever the caller's env
    assert seen["hub_offline"] is True
    assert done.stderr == "to stderr\n"
    # the rest of sys.path as in `python probe.py` with that environment (not pytest's)
    fresh = subprocess.run(
        [sys.executable, str(script), "ok"], cwd=tmp_path, env=env, capture_output=True, text=True, check=True
    )
    assert seen["path_rest"] == json.loads(fresh.stdout.splitlines()[0])["path_rest"]
    assert seen["path_rest"][:2] == [str(tmp_path / "lib"), str(tmp_path / "rel")]


@pytest.mark.parametrize(
    ("mode", "code", "stderr"),
    [
        ("exit", 3, "to stderr"),
        ("raise", 1, "RuntimeError: the reason"),
        ("kill", -signal.SIGKILL, "to stderr"),
    ],
)
def test_the_exit_status_is_the_scripts(script, mode, code, stderr):
    done = forked.run(script, [mode])
    assert done.returncode == code
    assert stderr in done.stderr
    # atexit handlers run on a normal exit, as in a fresh interpreter; a SIGKILL runs nothing
    assert ("atexit ran" in done.stdout) == (mode != "kill")


def test_a_run_past_its_timeout_is_killed(script):
    with pytest.raises(subprocess.TimeoutExpired):
        forked.run(script, ["hang"], timeout=2)
