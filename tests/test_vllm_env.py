"""The ``vllm`` tests (tests/test_vllm.py) on a machine whose test environment has no vLLM, and what
``use_vllm=True`` does without it.

vLLM's CPU build pins another ``transformers`` than the main environment and brings CUDA wheels that
break it, so it lives in an environment of its own (:mod:`rlhf_trainers.testing.vllm_env`, built on first
use, ~3 minutes on an idle machine, ~3.7 GB, then cached in ``~/.cache/rlhf_trainers/``). The proxy test
below runs tests/test_vllm.py, tests/test_vllm_agents.py and tests/test_vllm_server.py there with this checkout on ``PYTHONPATH``; a
failure there fails it, with the output. The environment is built by a fixture, under the build's own limit
(``vllm_env.BUILD_TIMEOUT_S``): the test's timeout counts only the tests' run (``func_only``), so a slow
build on a busy machine does not use it up. Where the test
interpreter has vLLM itself, the proxy is deselected and the vllm tests run directly
(tests/conftest.py). ``RLHF_TRAINERS_VLLM_TESTS=0`` skips the proxy on purpose (e.g. offline).
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_trainers import RLOOConfig, RLOOTrainer
from rlhf_trainers.testing import true_reward

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def vllm_interpreter() -> Path:
    """The vLLM environment's interpreter, built here (in the test's setup, outside its timed part) if it
    is not yet; skips the test under ``RLHF_TRAINERS_VLLM_TESTS=0``."""
    if os.environ.get("RLHF_TRAINERS_VLLM_TESTS") == "0":
        pytest.skip("RLHF_TRAINERS_VLLM_TESTS=0: the vllm tests were not run")
    from rlhf_trainers.testing.vllm_env import vllm_python

    return vllm_python()


@pytest.mark.vllm_proxy
@pytest.mark.slow
@pytest.mark.timeout(1800, func_only=True)  # the tests' run only: the build has its own limit
def test_vllm_tests_pass_in_the_vllm_environment(vllm_interpreter):
    from rlhf_trainers.testing.vllm_env import vllm_env_variables

    python = vllm_interpreter
    # One process (no xdist in that environment): setup.cfg's -ra only (--dist and --strict-markers need xdist).
    names = ("test_vllm.py", "test_vllm_agents.py", "test_vllm_server.py")
    modules = [str(REPO / "tests" / name) for name in names]
    command = [str(python), "-m", "pytest", *modules, "-q", "-x"]
    command += ["-p", "no:cacheprovider", "-o", "addopts=-ra"]
    done = subprocess.run(
        command,
        cwd=REPO,
        env=vllm_env_variables(REPO),
        capture_output=True,
        text=True,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"the vllm tests failed in {python}:\n{output[-8000:]}"
    summary = [line for line in output.splitlines() if " passed" in line]
    assert summary and "skipped" not in summary[-1], output[-3000:]
    print(summary[-1])


@pytest.mark.vllm_proxy
def test_use_vllm_without_vllm_says_how_to_install_it_at_construction(kit, tmp_path):
    config = RLOOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        rloo_k=4,
        response_length=8,
        use_cpu=True,
        report_to="none",
        use_vllm=True,
    )
    with pytest.raises(ImportError, match=r"use_vllm=True needs vLLM.*pip install vllm"):
        RLOOTrainer(
            model=kit.load_model("llama-hd32-sft"),
            processing_class=kit.load_tokenizer(),
            args=config,
            reward_funcs=true_reward,
            train_dataset=kit.prompt_dataset("train", n=16),
        )


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("vllm_mode", "remote", r"vllm_mode='remote': expected 'colocate' .* or 'server'"),
        (
            "vllm_gpu_memory_utilization",
            0.0,
            r"vllm_gpu_memory_utilization=0.0: expected a fraction in \(0, 1\]",
        ),
        ("vllm_gpu_memory_utilization", 1.5, "vllm_gpu_memory_utilization=1.5"),
        ("vllm_kv_cache_space_gib", 0, "vllm_kv_cache_space_gib=0: expected a whole number of GiB"),
        ("vllm_kv_cache_space_gib", 1.5, "vllm_kv_cache_space_gib=1.5"),
        ("vllm_tensor_parallel_size", 2, "set vllm_tensor_parallel_size=1"),
        ("vllm_dtype", "fp8", "vllm_dtype='fp8': expected one of"),
        ("vllm_max_model_length", 8, "expected an integer > response_length=8"),
        ("vllm_importance_sampling_mode", "token", "vllm_importance_sampling_mode='token': expected one of"),
        (
            "vllm_importance_sampling_cap",
            0.0,
            "vllm_importance_sampling_cap=0.0: expected a finite number > 0",
        ),
        ("vllm_importance_sampling_cap", float("inf"), "vllm_importance_sampling_cap=inf"),
        ("generation_loop", "transformers", "vLLM replaces the generation loop"),
        ("truncated_is_cap", 2.0, "truncated_is_cap with use_vllm=True"),
    ],
)
def test_vllm_settings_are_checked_when_the_config_is_built(tmp_path, field, value, message):
    with pytest.raises(ValueError, match=message):
        RLOOConfig(output_dir=str(tmp_path), rloo_k=2, response_length=8, use_vllm=True, **{field: value})


def test_vllm_settings_are_not_checked_without_use_vllm(tmp_path):
    config = RLOOConfig(output_dir=str(tmp_path), vllm_mode="server", vllm_dtype="fp8")
    assert not config.use_vllm


def test_vllms_logprobs_may_be_the_rollouts(tmp_path):
    """rollout_logprobs='generation' with use_vllm=True is accepted (vLLM's log-probs as the old ones, no
    policy forward pass: tests/test_vllm.py checks the trainer); with dropout on it is refused as for the
    builtin loop, since the training pass would then not be the policy that sampled."""
    config = RLOOConfig(
        output_dir=str(tmp_path), rloo_k=2, response_length=8, use_vllm=True, rollout_logprobs="generation"
    )
    assert config.rollout_logprobs == "generation" and config.vllm_importance_sampling_correction
    with pytest.raises(ValueError, match="disable_dropout=False"):
        RLOOConfig(
            output_dir=str(tmp_path),
            rloo_k=2,
            response_length=8,
            use_vllm=True,
            rollout_logprobs="generation",
            disable_dropout=False,
        )


def test_a_build_step_past_the_builds_limit_fails_with_what_to_do(tmp_path):
    from rlhf_trainers.testing import vllm_env

    log = tmp_path / "build.log"
    log.write_text("")
    with pytest.raises(
        RuntimeError, match=r"took longer than its limit.*python -m rlhf_trainers.testing.vllm_env"
    ):
        vllm_env._run([sys.executable, "-c", "import time; time.sleep(30)"], log, timeout_s=0.5)


def test_the_build_runs_its_steps_under_one_limit_and_once(tmp_path, monkeypatch):
    """A fake build (pip never runs): every step is given what is left of ``timeout_s``; a complete
    environment is returned at once afterwards."""
    from rlhf_trainers.testing import vllm_env

    steps = []
    root = tmp_path / "env"

    def fake_run(command, log, env=None, timeout_s=None):
        root.mkdir(exist_ok=True)  # what `python -m venv` would do
        steps.append(timeout_s)

    monkeypatch.setattr(vllm_env, "_run", fake_run)
    assert vllm_env.vllm_python(root, quiet=True, timeout_s=100) == root / "bin" / "python"
    assert len(steps) == 4 and all(0 < left <= 100 for left in steps), steps
    assert vllm_env.vllm_python(root, quiet=True, timeout_s=100) == root / "bin" / "python"
    assert len(steps) == 4  # built once
    assert vllm_env.BUILD_TIMEOUT_S >= 1800  # generous: a busy 2-core machine


def test_the_proxy_builds_the_environment_outside_its_timed_part():
    """pytest-timeout's ``func_only``: the fixture's build (setup) does not count against the 1800 s."""
    marker = test_vllm_tests_pass_in_the_vllm_environment.pytestmark
    timeout = next(m for m in marker if m.name == "timeout")
    assert timeout.kwargs.get("func_only") is True
    assert "vllm_interpreter" in inspect.signature(test_vllm_tests_pass_in_the_vllm_environment).parameters
