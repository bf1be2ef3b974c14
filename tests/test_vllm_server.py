"""``use_vllm=True, vllm_mode="server"``: generation by a separate ``rlhf-trainers vllm-serve``
(rlhf_trainers.generation.vllm_server), weights synced through vLLM's weight-transfer API with the gloo engine.

Run in the vLLM environment, as tests/test_vllm.py (tests/test_vllm_env.py runs them there). One server
for the module, started from the kit's ``llama-hd32-sft`` checkpoint; every trainer syncs its own weights
into it before its first generation, so the tests do not depend on each other's order.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_rloo import StopAt
from test_vllm import LEARNING_RUN, POLICY, _forward_logprobs, _learns, _trainer, grpo_trainer

from rlhf_trainers import PPOTrainer, RLOOTrainer
from rlhf_trainers.generation import GenerationError
from rlhf_trainers.generation.server_client import VLLMServerClient

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(model: str, log: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """``rlhf-trainers vllm-serve`` for ``model`` on a free port of 127.0.0.1 (output in ``log``); its
    process and URL, once ``/health`` answers (at most 300 s)."""
    port = _free_port()
    command = [
        sys.executable,
        "-m",
        "rlhf_trainers.cli",
        "vllm-serve",
        "--model",
        model,
        "--host",
        "127.0.0.1",
    ]
    command += ["--port", str(port), "--dtype", "float32", "--max_model_len", "256", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    client = VLLMServerClient(url)
    deadline = time.monotonic() + 300
    while not client.is_up():
        if process.poll() is not None or time.monotonic() > deadline:
            stop_server(process)
            raise RuntimeError(f"vllm-serve did not come up:\n{log.read_text()[-4000:]}")
        time.sleep(1)
    return process, url


def stop_server(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after 30 s."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module")
def server(kit, tmp_path_factory):
    """The URL of a vLLM server of the kit's policy checkpoint, for the module."""
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    # runtime LoRA on: the adapter-only sync's test loads adapters; the others' requests name no adapter
    process, url = start_server(str(kit.model_path(POLICY)), log, "--enable_lora", "--max_lora_rank", "8")
    yield url
    stop_server(process)


def _fixed_completion(kit) -> tuple[list[int], list[int]]:
    """A prompt and a completion (token ids) to score before and after updates."""
    tok = kit.load_tokenizer()
    prompt = tok("the movie was", add_special_tokens=False)["input_ids"]
    return prompt, tok(" really great and warm .", add_special_tokens=False)["input_ids"]


def _server_follows_training(kit, trainer) -> None:
    """Train; the server's log-probs of a fixed completion then equal the policy's forward (fp32, <= 1e-4)
    and differ from those before training."""
    prompt, completion = _fixed_completion(kit)
    backend = trainer.generation_backend
    before = backend.completion_logprobs([prompt], [completion])[0]
    trainer.train()
    after = backend.completion_logprobs([prompt], [completion])[0]
    torch.testing.assert_close(after, _forward_logprobs(trainer, prompt, completion), atol=1e-4, rtol=0)
    assert (after - before).abs().max() > 1e-2


def _update_entry(trainer, step):
    """The log entry of update ``step``."""
    return next(h for h in trainer.state.log_history if h.get("step") == step and "objective/kl" in h)


def _server_trainer(kit, tmp_path, server, trainer_cls=RLOOTrainer, **kwargs):
    return _trainer(kit, tmp_path, trainer_cls, vllm_mode="server", vllm_server_base_url=server, **kwargs)


# ---- the server follows the policy ----------------------------------------------------------------


def test_weight_syncs_make_the_server_score_like_the_policy(kit, tmp_path, server):
    """After each of several updates the server's log-probs of a fixed completion equal the trainer's forward
    pass in fp32 (<= 1e-4) and differ from those before it: every weight reached the server (the tied
    embedding and lm head too), once per update."""
    trainer = _server_trainer(kit, tmp_path, server, learning_rate=3e-2, max_steps=3)
    prompt, completion = _fixed_completion(kit)
    backend = trainer.generation_backend
    assert backend.name.startswith("vllm server")
    before = backend.completion_logprobs([prompt], [completion])[0]
    torch.testing.assert_close(before, _forward_logprobs(trainer, prompt, completion), atol=1e-4, rtol=0)
    trainer.train()
    assert backend.syncs == 3  # one before each update's generation
    after = backend.completion_logprobs([prompt], [completion])[0]
    assert backend.syncs == 4
    torch.testing.assert_close(after, _forward_logprobs(trainer, prompt, completion), atol=1e-4, rtol=0)
    assert (after - before).abs().max() > 1e-2
    logged = [h for h in trainer.state.log_history if "timing/weight_sync" in h]
    assert len(logged) == 3 and all(h["timing/weight_sync"] > 0 for h in logged)
    assert VLLMServerClient(server).weight_version() == "4"


# ---- learning -------------------------------------------------------------------------------------


@pytest.mark.parametrize("trainer_cls", [RLOOTrainer, PPOTrainer], ids=["rloo", "ppo"])
def test_trainers_learn_with_a_server(kit, tmp_path, server, trainer_cls):
    """RLOO and PPO learn the kit task with generation on the server; vLLM's samples are the trained
    distribution up to rounding (the mismatch metrics, fp32)."""
    trainer = _server_trainer(kit, tmp_path, server, trainer_cls, **LEARNING_RUN)
    _learns(trainer, 0.5)


def test_grpo_learns_with_a_server(kit, tmp_path, server):
    """GRPOTrainer with TRL's server-mode names (vllm_mode='server', vllm_server_base_url)."""
    _learns(grpo_trainer(kit, tmp_path, vllm_mode="server", vllm_server_base_url=server), 0.3)


def test_a_lora_adapter_reaches_the_server_merged(kit, tmp_path, server):
    """A LoRA adapter (attention and MLP; not the tied head: a server built from the base checkpoint holds
    the head and the embedding as one matrix, so such an adapter is refused) reaches the server merged into
    the base weights: after updates that moved the adapter, the server scores like the PEFT policy's forward.
    (That LoRA learns through a server is the SmolLM2 benchmark's: benchmarks/async_rollouts.py.)"""
    from peft import LoraConfig

    peft_config = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"], task_type="CAUSAL_LM"
    )
    trainer = _server_trainer(
        kit, tmp_path, server, PPOTrainer, peft_config=peft_config, learning_rate=3e-2, max_steps=2
    )
    _server_follows_training(kit, trainer)

    tied = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "lm_head"], task_type="CAUSAL_LM")
    with pytest.raises(ValueError, match=r"adapter on the tied input embedding or lm head"):
        _server_trainer(kit, tmp_path / "tied", server, PPOTrainer, peft_config=tied)


def test_an_adapter_only_sync_reaches_the_server_as_a_vllm_lora_adapter(kit, tmp_path, server):
    """vllm_lora_sync='adapter': only the LoRA adapter travels, written to vllm_lora_dir and loaded by the server
    as a vLLM LoRA adapter that the completions name: after updates that moved it, the server samples and
    scores like the PEFT policy's forward (fp32, <= 1e-4), its base weights were sent once, at the first
    sync (the module's server holds other tests' trained weights: without it the scores were off by 2
    nats), and only the newest adapter folder is left."""
    from peft import LoraConfig

    peft_config = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"], task_type="CAUSAL_LM"
    )
    trainer = _server_trainer(
        kit,
        tmp_path,
        server,
        PPOTrainer,
        peft_config=peft_config,
        learning_rate=3e-2,
        max_steps=2,
        vllm_lora_sync="adapter",
    )
    _server_follows_training(kit, trainer)
    logged = [
        h["sampling/sampling_logp_difference/max"] for h in trainer.state.log_history if "objective/kl" in h
    ]
    assert len(logged) == 2 and max(logged) <= 1e-4  # each update sampled from the adapter being trained
    backend = trainer.generation_backend
    assert backend.syncs == 3 and VLLMServerClient(server).weight_version() == "1"  # the base, once
    folder = Path(trainer.args.output_dir) / "vllm-lora"
    assert sorted(p.name for p in folder.iterdir()) == ["v3"]


# ---- resume ---------------------------------------------------------------------------------------


def test_resumed_run_logs_the_same_metrics_as_an_uninterrupted_one(kit, tmp_path, server):
    """The server's samples follow torch's generator (one seed per request), which the checkpoint restores:
    a run interrupted after update 2 and resumed logs updates 3 and 4 as the uninterrupted run does."""
    settings = {"max_steps": 4, "save_strategy": "steps", "save_steps": 2, "learning_rate": 5e-3, "seed": 3}
    full = _server_trainer(kit, tmp_path / "full", server, PPOTrainer, **settings)
    full.train()
    interrupted = _server_trainer(
        kit, tmp_path / "part", server, PPOTrainer, callbacks=[StopAt(2)], **settings
    )
    interrupted.train()
    resumed = _server_trainer(kit, tmp_path / "part", server, PPOTrainer, **settings)
    resumed.train(resume_from_checkpoint=True)

    for step in (3, 4):
        a, b = _update_entry(full, step), _update_entry(resumed, step)
        for key in ("objective/scores", "objective/kl", "val/response_length", "loss/policy_avg"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (step, key, a[key], b[key])


# ---- faults ---------------------------------------------------------------------------------------


def test_a_server_of_another_model_is_refused_before_any_weight_is_sent(kit, tmp_path, server):
    """A policy whose sizes differ from the served model's is refused when the trainer is built, with the
    differing fields; the server's weights are untouched."""
    version = VLLMServerClient(server).weight_version()
    with pytest.raises(ValueError, match=r"serves another model .*num_attention_heads: policy 4 vs server 2"):
        _server_trainer(kit, tmp_path, server, model="llama-sft")
    assert VLLMServerClient(server).weight_version() == version


def test_a_sync_failing_half_way_leaves_the_server_paused_then_is_redone_in_full(
    kit, tmp_path, server, monkeypatch
):
    """A sync that fails half way is retried in full; one that fails twice is an error naming the server,
    which is left paused (it serves no mix of old and new weights); the next generation syncs in full and
    resumes it, after which it scores like the trainer's forward."""
    from rlhf_trainers.generation import weight_transfer

    trainer = _server_trainer(kit, tmp_path, server, learning_rate=3e-2, max_steps=1)
    prompt, completion = _fixed_completion(kit)
    backend = trainer.generation_backend
    backend.completion_logprobs([prompt], [completion])  # synced with the weights of before
    trainer.train()
    assert backend.is_stale()

    send = weight_transfer.GlooSender.send
    calls = {"n": 0, "failures": 0}
    total = len(backend._manifest)

    def fail_half_way(self, tensors):
        calls["n"] += 1
        if calls["n"] % total == total // 2 and calls["failures"] < calls["allowed"]:
            calls["failures"] += 1
            raise OSError("the connection to the server dropped")
        send(self, tensors)

    client = VLLMServerClient(server)
    calls["allowed"] = 1  # once: the retry succeeds
    monkeypatch.setattr(weight_transfer.GlooSender, "send", fail_half_way)
    backend.sync_weights()
    assert calls["failures"] == 1 and not client.is_paused() and not backend.is_stale()
    torch.testing.assert_close(
        backend.completion_logprobs([prompt], [completion])[0],
        _forward_logprobs(trainer, prompt, completion),
        atol=1e-4,
        rtol=0,
    )

    with torch.no_grad():
        for p in trainer.policy.parameters():
            p.add_(0.01)
    calls.update(n=0, failures=0, allowed=2)  # twice: the sync fails
    with pytest.raises(GenerationError, match=r"(?s)at http://127\.0\.0\.1:\d+ failed twice.*left paused"):
        backend.sync_weights()
    assert client.is_paused() and backend.is_stale()
    monkeypatch.setattr(weight_transfer.GlooSender, "send", send)
    after = backend.completion_logprobs([prompt], [completion])[0]
    assert not client.is_paused()
    torch.testing.assert_close(after, _forward_logprobs(trainer, prompt, completion), atol=1e-4, rtol=0)


def test_a_server_dying_mid_run_saves_the_last_complete_update_and_resume_works(kit, tmp_path):
    """A server killed after update 2: the error names the server, the second update is in checkpoint-2,
    and after a restart of the server the run resumes from it and finishes."""
    from transformers import TrainerCallback

    model = str(kit.model_path(POLICY))
    process, url = start_server(model, tmp_path / "dying.log")

    class KillServerAfter(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                stop_server(process)

    settings = {"max_steps": 4, "learning_rate": 5e-3, "seed": 3}
    try:
        trainer = _server_trainer(kit, tmp_path, url, callbacks=[KillServerAfter()], **settings)
        with pytest.raises(GenerationError) as raised:
            trainer.train()
        message = str(raised.value)
        assert url in message and "step 2" in message and "resume_from_checkpoint" in message
        checkpoint = tmp_path / "out" / "checkpoint-2"
        assert (checkpoint / "trainer_state.json").is_file()
    finally:
        stop_server(process)
    process, url2 = start_server(model, tmp_path / "restarted.log")  # a restarted server (on another port)
    try:
        resumed = _server_trainer(kit, tmp_path, url2, **settings)
        resumed.train(resume_from_checkpoint=str(checkpoint))
        assert resumed.state.global_step == 4
    finally:
        stop_server(process)


# ---- asynchronous rollouts ------------------------------------------------------------------------


def _staleness(trainer):
    return [h["rollout/staleness"] for h in trainer.state.log_history if "rollout/staleness" in h]


def test_async_rollouts_train_on_responses_of_the_previous_weights_and_learn(kit, tmp_path, server):
    """async_rollouts: update u+1's responses are generated while update u trains, with u's weights: the
    first update's are fresh (staleness 0), every later one's one update stale, which the importance ratio
    pi_train / pi_server shows (it moves off 1, unlike a synchronous fp32 run's); RLOO still learns."""
    trainer = _server_trainer(
        kit, tmp_path, server, async_rollouts=True, rloo_k=4, logging_steps=1, **LEARNING_RUN
    )
    before = trainer.evaluate()["eval_objective/scores/true_reward"]
    trainer.train()
    after = trainer.evaluate()["eval_objective/scores/true_reward"]
    assert after - before >= 0.4, (before, after)
    assert _staleness(trainer) == [0.0] + [1.0] * (LEARNING_RUN["max_steps"] - 1)
    ratios = [
        h["sampling/importance_sampling_ratio/mean"]
        for h in trainer.state.log_history
        if "rollout/staleness" in h
    ]
    assert abs(ratios[0] - 1) < 1e-3 and max(abs(r - 1) for r in ratios[1:]) > 1e-3, ratios
    assert all("timing/generate_wait" in h for h in trainer.state.log_history[1:] if "rollout/staleness" in h)


def test_async_rollouts_with_a_colocated_engine_sample_what_a_server_samples(kit, tmp_path, server):
    """A colocated engine generates ahead at the same point, with the same weights and seeds, without
    overlap: the two runs log the same scores update by update."""
    settings = {"async_rollouts": True, "max_steps": 3, "learning_rate": 5e-3, "seed": 3, "logging_steps": 1}
    on_server = _server_trainer(kit, tmp_path / "server", server, **settings)
    on_server.train()
    colocated = _trainer(kit, tmp_path / "colocated", RLOOTrainer, **settings)
    assert not colocated.producer.ahead.overlaps
    colocated.train()
    assert _staleness(colocated) == _staleness(on_server) == [0.0, 1.0, 1.0]
    for a, b in zip(on_server.state.log_history, colocated.state.log_history, strict=False):
        if "objective/scores" in a:
            assert a["objective/scores"] == pytest.approx(b["objective/scores"], abs=1e-4)


def test_async_rollouts_resume_exactly_with_the_responses_in_flight(kit, tmp_path, server):
    """The checkpoint of update 2 holds the responses generated for update 3 with update 2's weights; the
    resumed run trains on them and logs updates 3 and 4 as the uninterrupted run does."""
    settings = {
        "async_rollouts": True,
        "max_steps": 4,
        "save_strategy": "steps",
        "save_steps": 2,
        "learning_rate": 5e-3,
        "seed": 3,
    }
    full = _server_trainer(kit, tmp_path / "full", server, PPOTrainer, **settings)
    full.train()
    interrupted = _server_trainer(
        kit, tmp_path / "part", server, PPOTrainer, callbacks=[StopAt(2)], **settings
    )
    interrupted.train()
    assert (tmp_path / "part" / "out" / "checkpoint-2" / "rollout_ahead-0.pt").is_file()
    resumed = _server_trainer(kit, tmp_path / "part", server, PPOTrainer, **settings)
    resumed.train(resume_from_checkpoint=True)

    for step in (3, 4):
        a, b = _update_entry(full, step), _update_entry(resumed, step)
        for key in (
            "objective/scores",
            "objective/kl",
            "val/response_length",
            "loss/policy_avg",
            "rollout/staleness",
        ):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (step, key, a[key], b[key])


# ---- several servers ------------------------------------------------------------------------------


def _finished_requests(url: str) -> float:
    """The requests a server finished (its Prometheus counter ``vllm:request_success_total``)."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total")
    )


def test_two_servers_share_the_rows_and_both_get_every_sync(kit, tmp_path, server):
    """vllm_server_base_url with two URLs: each rollout's rows are split between the servers, every
    update's weights reach both (same version, both score like the policy's forward)."""
    process, other = start_server(str(kit.model_path(POLICY)), tmp_path / "second.log")
    try:
        before = [_finished_requests(url) for url in (server, other)]
        trainer = _server_trainer(kit, tmp_path, f"{server},{other}", learning_rate=3e-2, max_steps=2)
        trainer.train()
        served = [
            a - b for a, b in zip([_finished_requests(u) for u in (server, other)], before, strict=True)
        ]
        assert served[0] == served[1] and sum(served) == 2 * trainer.batch_size, (
            served
        )  # half of each rollout
        assert VLLMServerClient(server).weight_version() == VLLMServerClient(other).weight_version() == "2"
        prompt, completion = _fixed_completion(kit)
        forward = _forward_logprobs(trainer, prompt, completion)
        backend = trainer.generation_backend
        for index in (0, 1):  # the last update's weights, synced to both
            scored = backend.completion_logprobs([prompt], [completion], server=index)[0]
            torch.testing.assert_close(scored, forward, atol=1e-4, rtol=0)
    finally:
        stop_server(process)


# ---- several machines -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_machines_sample_from_one_server_that_the_first_syncs(kit, tmp_path, server):
    """A run started as two machines (``accelerate launch --num_machines 2``, one process each, DDP), both
    generating on one server, as docs/distributed.md's multi-node recipe runs: the first machine syncs the
    server before each generation and the second waits for it, so every rollout of both was sampled from the
    weights being trained (fp32 mismatch <= 1e-4 on each), both end with the same weights, and the server
    holds the last sync's weights."""
    from distributed import read_rank_results
    from machines import launch_machines

    out = tmp_path / "run"  # a shared filesystem: each machine writes its rank's result there
    updates = 3
    args = ["--output_dir", str(out), "--max_steps", str(updates), "--num_eval_prompts", "16"]
    launch_machines("vllm_distributed.py", [[*args, "--vllm_server_base_url", server]] * 2)
    rank0, rank1 = read_rank_results(out)
    assert rank0["world_size"] == 2 and rank0["global_step"] == updates
    assert rank0["generation"].startswith("vllm server") and rank1["generation"] == rank0["generation"]
    assert rank0["policy_digest"] == rank1["policy_digest"] != rank0["policy_before"]
    for result in (rank0, rank1):
        assert len(result["logp_diff_max"]) == updates and max(result["logp_diff_max"]) <= 1e-4
    # a sync before the first evaluation, each update after the first, and the last evaluation; DDP's start
    # (parameters broadcast in place) may add one
    assert rank0["syncs"] == rank1["syncs"] and updates + 1 <= rank0["syncs"] <= updates + 2
    assert VLLMServerClient(server).weight_version() == str(rank0["syncs"])
