"""Shared fixtures (the offline kit, :mod:`rlhf_trainers.testing`) and how the suite runs in parallel.

The README's test command runs the suite on ``pytest-xdist`` workers (``-n auto``, at most
:data:`MAX_WORKERS`; ``-n 0`` runs it in one process). Each worker, and every process a test starts,
runs torch on one thread: the kit's models are far too small to gain from a second one, and two
workers with two threads each on two cores would only wait for each other.

Tests that share an expensive module- or class-scoped fixture (a trained model, a distributed run whose
results several tests check) stay on one worker (``--dist loadgroup``, one group per module), so the
fixture is computed once; all other tests are spread one by one. Workers take them in the order of
:func:`pytest_collection_modifyitems` (``--no-loadscope-reorder``): the longest first, so that the run
does not end on one worker alone with a long test (the vLLM proxy, ~4 minutes, started last in
alphabetical order, left one of two workers idle for most of that).

Tests that run a script as a fresh process (a docs page, a trainer killed while saving) start it from a
fork of a server that has the heavy imports done (``tests/forked.py``): ~5 s of CPU less per run. So do
the ranks of the multi-process tests (``tests/distributed.py``), with the environments ``accelerate
launch`` gives them; ``RLHF_TESTS_LAUNCHER=accelerate`` starts those through ``accelerate launch``.
"""

from __future__ import annotations

import os

# Before torch is imported anywhere (workers and the subprocesses they start inherit it).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from rlhf_trainers.testing import OfflineKit, get_kit

#: Upper bound of ``-n auto``: each worker holds torch and a few models (~0.5-1 GiB).
MAX_WORKERS = 4


@pytest.hookimpl(optionalhook=True)  # an xdist hook; the vLLM environment runs without xdist
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per CPU this process may use, at most :data:`MAX_WORKERS`."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_WORKERS))


def vllm_importable() -> bool:
    """Whether this interpreter has vLLM (found, not imported: importing it costs seconds)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep each module whose tests share a module- or class-scoped fixture on one xdist worker. Where
    vLLM is not installed, the ``vllm`` tests are deselected here and run by ``tests/test_vllm_env.py``
    in a vLLM environment instead; where it is, that proxy is deselected."""
    has_vllm = vllm_importable()
    keep, dropped = [], []
    for item in items:
        is_vllm = item.get_closest_marker("vllm") is not None
        is_proxy = item.get_closest_marker("vllm_proxy") is not None
        (dropped if (is_vllm and not has_vllm) or (is_proxy and has_vllm) else keep).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        shared = any(
            defs[-1].scope in ("module", "class")
            for name in item.fixturenames
            if (defs := info.name2fixturedefs.get(name))
        )
        if shared:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    # When xdist hands each test out (a stable sort of the collection): the vLLM proxy first (the longest
    # test by far), then every module that has a `slow` test (each module kept together in its own
    # order, so its module-scoped fixtures are built once), then the rest.
    slow_modules = {
        item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow") is not None
    }

    def start_order(item: pytest.Item) -> int:
        if item.get_closest_marker("vllm_proxy") is not None and item.get_closest_marker("slow") is not None:
            return 0
        return 1 if item.nodeid.split("::")[0] in slow_modules else 2

    items.sort(key=start_order)


@pytest.fixture(scope="session")
def kit() -> OfflineKit:
    """The offline kit from the default cache folder (built on first use, 10-15 s on 2 CPU cores)."""
    return get_kit()


@pytest.fixture(scope="module")
def policy(kit):
    """The kit's SFT Llama policy in eval mode (the sampling and generation tests)."""
    return kit.load_model("llama-sft").eval()


@pytest.fixture(scope="module")
def prompts(kit):
    """(tokenizer, ids, mask): a left-padded batch of 8 kit prompts with rows of different lengths."""
    tok = kit.load_tokenizer()
    texts = list(kit.prompt_dataset("train", n=8)["prompt"])
    texts[0] = texts[0] + " " + texts[1]  # rows of different lengths: left padding in the others
    batch = tok(texts, return_tensors="pt", padding=True)
    assert (batch["attention_mask"] == 0).any()
    return tok, batch["input_ids"], batch["attention_mask"]


@pytest.fixture(scope="module")
def reward_model_dir(kit, tmp_path_factory):
    """A reward model trained by RewardTrainer on the kit's synthetic preferences, saved with its tokenizer
    (:func:`rlhf_trainers.testing.kit_reward.train_kit_reward_model`)."""
    from rlhf_trainers.testing.kit_reward import train_kit_reward_model

    out = tmp_path_factory.mktemp("rm")
    train_kit_reward_model(kit, out)
    return out
