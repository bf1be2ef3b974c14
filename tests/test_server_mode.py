"""``vllm_mode="server"`` without vLLM: the config's checks, the ``vllm-serve`` command line, and how the
client meets a server that is not there, is slow or answers with an error (a stand-in HTTP server).
Training against a real vLLM server is tests/test_vllm_server.py (in the vLLM environment)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlhf_trainers import RLOOConfig, RLOOTrainer
from rlhf_trainers.cli import main as cli_main
from rlhf_trainers.generation.server_client import ServerError, VLLMServerClient
from rlhf_trainers.generation.vllm_server import server_urls
from rlhf_trainers.testing import true_reward


def _config(tmp_path, **overrides):
    settings = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        rloo_k=4,
        response_length=8,
        use_cpu=True,
        report_to="none",
        use_vllm=True,
        vllm_mode="server",
    )
    return RLOOConfig(**{**settings, **overrides})


# ---- configuration --------------------------------------------------------------------------------


def test_server_urls_from_the_base_url_or_host_and_port():
    assert server_urls(None, "0.0.0.0", 8000) == ["http://0.0.0.0:8000"]
    assert server_urls("http://a:1, http://b:2", "x", 0) == ["http://a:1", "http://b:2"]
    assert server_urls(["http://a:1"], "x", 0) == ["http://a:1"]
    with pytest.raises(ValueError, match="expected one URL"):
        server_urls("a:1", "x", 0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"vllm_server_base_url": "localhost:8000"},
            r"vllm_server_base_url='localhost:8000': expected one URL",
        ),
        ({"vllm_server_timeout": 0}, r"vllm_server_timeout=0: expected seconds > 0"),
        ({"vllm_group_port": 70000}, r"vllm_group_port=70000: expected a TCP port"),
        ({"vllm_lora_sync": "delta"}, r"vllm_lora_sync='delta': expected 'merged' .* or 'adapter'"),
        (
            {"vllm_lora_sync": "adapter", "vllm_mode": "colocate"},
            r"vllm_lora_sync='adapter' is for vllm_mode='server'",
        ),
    ],
)
def test_bad_server_settings_are_refused_at_construction(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, **overrides)


def test_a_server_that_is_not_up_is_waited_for_then_refused_naming_it(kit, tmp_path):
    """Nothing listens at the URL: the trainer waits vllm_server_timeout seconds, then says which server
    did not answer and how to start one."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    with pytest.raises(
        ServerError, match=rf"no vLLM server answered at {url} within 2 s.*rlhf-trainers vllm-serve"
    ):
        RLOOTrainer(
            model=kit.load_model("llama-hd32-sft"),
            processing_class=kit.load_tokenizer(),
            args=_config(tmp_path, vllm_server_base_url=url, vllm_server_timeout=2),
            train_dataset=kit.prompt_dataset("train", n=16),
            reward_funcs=[true_reward],
        )
    assert 2 <= time.monotonic() - started < 30


# ---- the vllm-serve command -----------------------------------------------------------------------


def test_vllm_serve_starts_vllms_server_with_what_training_needs(capsys):
    cli_main(
        ["vllm-serve", "--model", "/m", "--port", "8123", "--device", "cpu", "--print_command", "--", "--x"]
    )
    line = capsys.readouterr().out
    assert line.startswith("VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 ")
    for part in (
        "-m vllm.entrypoints.launchers.api_server.entry --model /m",
        "--port 8123",
        """--weight-transfer-config '{"backend": "gloo"}'""",
        "--worker-extension-cls rlhf_trainers.generation.weight_transfer.GlooWorkerExtension",
        "--logprobs-mode processed_logprobs --generation-config vllm",
        "--enforce-eager --block-size 32 --enable-prefix-caching --no-enable-chunked-prefill",
    ):
        assert part in line, part
    assert line.rstrip().endswith("--x")
    cli_main(
        ["vllm-serve", "--model", "/m", "--device", "cuda", "--tensor_parallel_size", "2", "--print_command"]
    )
    line = capsys.readouterr().out
    assert "--tensor-parallel-size 2" in line and "--gpu-memory-utilization 0.9" in line
    assert "--enforce-eager" not in line and "VLLM_CPU_KVCACHE_SPACE" not in line
    assert "--enable-lora" not in line
    cli_main(["vllm-serve", "--model", "/m", "--enable_lora", "--max_lora_rank", "16", "--print_command"])
    line = capsys.readouterr().out
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in line
    assert "--enable-lora --max-lora-rank 16 --max-loras 1" in line


# ---- the client against a stand-in server ---------------------------------------------------------


class _StandIn(BaseHTTPRequestHandler):
    """/health answers; /v1/completions sleeps ``delay`` seconds, then answers; /pause fails with 500."""

    delay = 0.0

    def log_message(self, *args):  # quiet
        pass

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except BrokenPipeError:  # the client gave up (the timeout test)
            pass

    def do_GET(self):
        self._answer(200, {})

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        if self.path.startswith("/v1/completions"):
            time.sleep(self.delay)
            self._answer(200, {"choices": [{"token_ids": [5, 6], "logprobs": None}]})
        else:
            self._answer(500, {"error": {"message": "Weight update failed: boom"}})


@pytest.fixture
def stand_in():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_a_slow_server_is_an_error_after_the_timeout_naming_it_and_the_route(stand_in):
    client = VLLMServerClient(stand_in, timeout_s=1)
    assert client.is_up()
    assert client.complete([1, 2], {"max_tokens": 2}) == ([5, 6], None)
    _StandIn.delay = 3.0
    try:
        with pytest.raises(
            ServerError, match=rf"{stand_in} did not answer POST /v1/completions: .*timed out"
        ):
            client.complete([1, 2], {"max_tokens": 2})
    finally:
        _StandIn.delay = 0.0


def test_a_server_error_carries_the_servers_message(stand_in):
    with pytest.raises(
        ServerError, match=rf"{stand_in} answered POST /pause with 500: .*Weight update failed: boom"
    ):
        VLLMServerClient(stand_in).pause()


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"use_vllm": False}, r"async_rollouts=True needs use_vllm=True"),
        ({"max_staleness": 2}, r"max_staleness=2: only 1 is implemented"),
    ],
)
def test_async_rollouts_settings_are_checked_at_construction(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, async_rollouts=True, **overrides)


# ---- adapter-only sync ----------------------------------------------------------------------------


def test_an_adapter_only_sync_refuses_what_vllms_lora_cannot_serve(kit, tmp_path):
    """vllm_lora_sync='adapter' needs a LoRA adapter whose every trained weight is low-rank, and a server with
    runtime LoRA of a large enough rank: each is refused with what to change."""
    from peft import LoraConfig, get_peft_model

    from rlhf_trainers.generation.lora_adapter_sync import AdapterPublisher

    with pytest.raises(ValueError, match=r"the policy has none: pass peft_config="):
        AdapterPublisher(kit.load_model("llama-sft"), tmp_path, write=True)
    dora = get_peft_model(
        kit.load_model("llama-sft"), LoraConfig(r=8, target_modules=["q_proj"], use_dora=True)
    )
    with pytest.raises(ValueError, match=r"DoRA \(use_dora=True\), which vLLM's LoRA cannot apply"):
        AdapterPublisher(dora, tmp_path, write=True)
    saved = get_peft_model(
        kit.load_model("llama-sft"), LoraConfig(r=8, target_modules=["q_proj"], modules_to_save=["lm_head"])
    )
    with pytest.raises(ValueError, match=r"modules_to_save"):
        AdapterPublisher(saved, tmp_path, write=True)

    plain = get_peft_model(kit.load_model("llama-sft"), LoraConfig(r=16, target_modules=["q_proj"]))
    publisher = AdapterPublisher(plain, tmp_path / "lora", write=True)
    client = VLLMServerClient("http://127.0.0.1:9")
    with pytest.raises(
        ValueError, match=r"has LoRA off; start it with `rlhf-trainers vllm-serve --enable_lora"
    ):
        publisher.check_server(client, None)
    with pytest.raises(ValueError, match=r"rank r=16 exceeds .*--max-lora-rank 8; restart it"):
        publisher.check_server(client, {"max_lora_rank": 8})
    publisher.check_server(client, {"max_lora_rank": 64})


def test_adapter_versions_are_written_whole_and_only_the_last_is_kept(kit, tmp_path):
    """Each sync writes the adapter as a PEFT adapter folder of its own (vLLM keys its prefix cache on the
    path), loadable by PEFT with the trained values; older versions are removed once the newest is loaded;
    every process names the adapter alike."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model

    from rlhf_trainers.generation.lora_adapter_sync import AdapterPublisher

    model = get_peft_model(kit.load_model("llama-sft"), LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    publisher = AdapterPublisher(model, tmp_path / "lora", write=True)
    assert AdapterPublisher(model, tmp_path / "lora", write=False).lora_name == publisher.lora_name
    first = publisher.publish()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(0.5)
    second = publisher.publish()
    assert (first.name, second.name) == ("v1", "v2") and first.is_dir()
    publisher.prune()
    assert sorted(p.name for p in (tmp_path / "lora").iterdir()) == ["v2"]
    loaded = PeftModel.from_pretrained(kit.load_model("llama-sft"), str(second))
    ids = torch.tensor([[3, 4, 5, 6]])
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    assert AdapterPublisher(model, tmp_path / "lora", write=False).publish() is None
