"""Run a Python script as a fresh process would, from a fork of a server that has already imported torch,
transformers' Trainer and this package (``multiprocessing``'s forkserver with those modules preloaded).

Why: a test that runs a script in a subprocess (a docs page, a trainer that kills itself while saving)
pays ~5 s of CPU on these 2 cores to import those modules before the script does anything; the suite
starts ~30 such processes. A fork of the preloaded server starts in milliseconds.

What stays as in a fresh process: the script runs as ``__main__`` with its own ``sys.argv``, ``sys.path``
(the script's folder first, then the interpreter's own entries, not pytest's), working directory and
environment, and a copy of a process that has only imported modules (no model built, no torch op run,
one torch thread: ``OMP_NUM_THREADS=1`` is set by ``conftest.py`` before the server starts). At the end
the ``atexit`` handlers run, as at a normal interpreter exit, and the exit status is the script's
(``sys.exit`` code, 1 after an uncaught exception, ``-signal`` when a signal killed it). What differs:
modules the script never imports are loaded (a script that forgets an import still fails: the names are
not in its namespace), and environment variables read at import time by the preloaded modules were read
with the server's environment: the pytest worker's plus the offline flags of :data:`SERVER_ENV`.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

#: What the server imports once; each run's fork starts with them loaded.
PRELOAD = ["torch", "transformers", "transformers.trainer", "peft", "datasets", "rlhf_trainers"]

_context: multiprocessing.context.ForkServerContext | None = None
_interpreter_path: list[str] | None = None


#: Read once by the preloaded modules (huggingface_hub's and transformers' constants), so set in the
#: server's own environment: every forked script is offline, as the docs runner and the launches of
#: tests/distributed.py ask (Hub access fails fast instead of hanging).
SERVER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def _forkserver() -> multiprocessing.context.ForkServerContext:
    global _context
    if _context is None:
        from multiprocessing import forkserver

        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        # the server starts with this process's environment: SERVER_ENV added for its start only
        saved = {name: os.environ.get(name) for name in SERVER_ENV}
        os.environ.update(SERVER_ENV)
        try:
            forkserver.ensure_running()
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        _context = context
    return _context


def _fresh_sys_path() -> list[str]:
    """``sys.path`` of ``python script.py`` without ``PYTHONPATH`` and its first entry (the script's
    folder); the child puts its own environment's ``PYTHONPATH`` before it."""
    global _interpreter_path
    if _interpreter_path is None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        out = subprocess.run(
            [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        )
        _interpreter_path = json.loads(out.stdout)
    return _interpreter_path


def _child(
    script: str, argv: list[str], cwd: str, env: dict[str, str], path: list[str], logs: list[str]
) -> None:
    """In the fork: the script's stdout/stderr go to ``logs``; its cwd, environment, argv and path are
    set; it runs as ``__main__``; the process ends with its exit status after the ``atexit`` handlers."""
    import atexit
    import runpy

    sys.stdout.flush()
    sys.stderr.flush()
    for fd, log in zip((1, 2), logs, strict=True):
        target = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [script, *argv]
    extra = [os.path.abspath(entry) for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    sys.path[:] = [str(Path(script).parent), *extra, *path]
    code: int = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def start(
    script: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    logs: Sequence[str | os.PathLike[str]],
) -> multiprocessing.process.BaseProcess:
    """Start ``script`` with ``args`` from a fork of the preloaded server and return at once: the started
    process (``join``, ``exitcode``, ``terminate``, ``kill``, ``pid``). Its stdout and stderr go to the
    two files of ``logs``. :func:`run` waits for one; tests/distributed.py starts several (the ranks of a
    launch)."""
    process = _forkserver().Process(
        target=_child,
        args=(
            str(Path(script).resolve()),
            [str(a) for a in args],
            str(cwd or os.getcwd()),
            dict(os.environ if env is None else env),
            _fresh_sys_path(),
            [str(log) for log in logs],
        ),
    )
    process.start()
    return process


def run(
    script: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([sys.executable, script, *args], capture_output=True, text=True, ...)``, from a fork
    of the preloaded server. Returns the completed process (``returncode`` negative for a signal, as
    subprocess reports it); raises ``subprocess.TimeoutExpired`` after ``timeout`` seconds, with the run
    killed."""
    import tempfile

    script = str(Path(script).resolve())
    argv = [str(a) for a in args]
    with tempfile.TemporaryDirectory(prefix="forked-") as folder:
        logs = [os.path.join(folder, "stdout"), os.path.join(folder, "stderr")]
        started = time.monotonic()
        process = start(script, argv, cwd=cwd, env=env, logs=logs)
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired([script, *argv], time.monotonic() - started)
        out, err = (Path(log).read_text(errors="replace") if os.path.exists(log) else "" for log in logs)
    return subprocess.CompletedProcess([sys.executable, script, *argv], process.exitcode, out, err)
