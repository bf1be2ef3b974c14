"""A client of one ``vllm serve`` (standard library HTTP only): its OpenAI completions route with token ids
in and out, its health and model routes, and vLLM's RL routes (pause, resume, weight transfer) that
``VLLM_SERVER_DEV_MODE=1`` turns on (``rlhf-trainers vllm-serve`` sets it)."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

__all__ = ["ServerError", "VLLMServerClient", "address_towards"]

#: Printed where a server is missing or lacks what training needs.
START_A_SERVER = (
    'start one with `rlhf-trainers vllm-serve --model MODEL` (docs/generation.md, "vLLM servers")'
)


class ServerError(RuntimeError):
    """A vLLM server could not be reached or refused a request; the message names the server and the route."""


class VLLMServerClient:
    """The routes of one vLLM server at ``base_url`` (``http://host:port``) that training uses.

    Args:
        base_url: the server's address.
        timeout_s: seconds any one request may take (generation included) before it is an error.
    """

    def __init__(self, base_url: str, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        parts = urllib.parse.urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"vLLM server URL {base_url!r}: expected http://HOST:PORT.")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        #: The served model's id (the ``model`` field of completion requests), set by :meth:`describe`.
        self.model_id: str | None = None
        self.max_model_len: int | None = None

    def __repr__(self) -> str:
        return f"VLLMServerClient({self.base_url!r})"

    # ---- plumbing -------------------------------------------------------------------------------

    def request(
        self,
        method: str,
        route: str,
        body: dict[str, Any] | None = None,
        *,
        query: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """``method`` ``route`` with a JSON ``body``; the JSON answer (its text where it is not JSON, None when
        empty).

        Raises:
            ServerError: the server did not answer within the timeout, refused the connection, or answered
                with an error status (its message is included).
        """
        url = self.base_url + route
        if query:
            url += "?" + urllib.parse.urlencode(query)
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as answer:
                text = answer.read()
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:2000]
            raise ServerError(
                f"the vLLM server at {self.base_url} answered {method} {route} with {err.code}: {detail}"
            ) from err
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise ServerError(
                f"the vLLM server at {self.base_url} did not answer {method} {route}: {reason}"
            ) from err
        if not text.strip():
            return None
        try:
            return json.loads(text)
        except ValueError:  # some routes answer in plain text (/v1/load_lora_adapter)
            return text.decode(errors="replace")

    def is_up(self) -> bool:
        """Whether ``/health`` answers 200 now."""
        try:
            self.request("GET", "/health", timeout_s=5)
        except ServerError:
            return False
        return True

    def wait_until_up(self, timeout_s: float) -> None:
        """Poll ``/health`` until it answers, at most ``timeout_s`` seconds.

        Raises:
            ServerError: no answer in time (a server still loading its model, a wrong address).
        """
        deadline = time.monotonic() + timeout_s
        while not self.is_up():
            if time.monotonic() >= deadline:
                raise ServerError(
                    f"no vLLM server answered at {self.base_url} within {timeout_s:g} s "
                    f"(vllm_server_timeout). Check the address, wait for the server to load its model, or "
                    f"{START_A_SERVER}."
                )
            time.sleep(1.0)

    # ---- what the server serves -----------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """The served model (``/v1/models``) and the engine's settings (``/server_info``); sets
        :attr:`model_id` and :attr:`max_model_len`. Keys: ``model_id``, ``root``, ``max_model_len``,
        ``dtype``, ``logprobs_mode``, ``weight_transfer_backend``, ``lora`` (vLLM's LoRA settings, None when
        its LoRA is off)."""
        # LoRA adapters loaded at run time are listed too, with the base model as their parent
        models = [m for m in self.request("GET", "/v1/models")["data"] if not m.get("parent")]
        if len(models) != 1:
            raise ServerError(
                f"the vLLM server at {self.base_url} serves {len(models)} models; expected one."
            )
        model = models[0]
        self.model_id = model["id"]
        self.max_model_len = model.get("max_model_len")
        try:
            info = self.request("GET", "/server_info", query={"config_format": "json"})
        except ServerError as err:
            raise ServerError(
                f"{err}. Its development routes are off: training needs VLLM_SERVER_DEV_MODE=1 for vLLM's "
                f"weight-transfer routes; {START_A_SERVER}."
            ) from err
        config = info.get("vllm_config", {})
        model_config = config.get("model_config", {}) if isinstance(config, dict) else {}
        transfer = config.get("weight_transfer_config") if isinstance(config, dict) else None
        lora = config.get("lora_config") if isinstance(config, dict) else None
        return {
            "model_id": self.model_id,
            "root": model.get("root"),
            "max_model_len": self.max_model_len,
            "dtype": str(model_config.get("dtype", "")).removeprefix("torch."),
            "logprobs_mode": model_config.get("logprobs_mode"),
            "weight_transfer_backend": (transfer or {}).get("backend")
            if isinstance(transfer, dict)
            else None,
            "lora": lora if isinstance(lora, dict) else None,
        }

    def world_size(self) -> int:
        """The server's workers (tensor x pipeline x data parallel)."""
        return int(self.request("GET", "/get_world_size")["world_size"])

    def collective_rpc(self, method: str, *args: str) -> list[Any]:
        """Call ``method`` on every worker of the server (vLLM's ``/collective_rpc``); their answers."""
        answer = self.request("POST", "/collective_rpc", {"method": method, "args": list(args)})
        return [] if answer is None else answer.get("results", [])

    # ---- generation -----------------------------------------------------------------------------

    def complete(self, prompt_ids: list[int], params: dict[str, Any]) -> tuple[list[int], list[float] | None]:
        """One completion of ``prompt_ids`` (``/v1/completions``, token ids in and out); ``params`` are the
        request's sampling fields. Returns the sampled ids and, where ``params`` ask for ``logprobs``, the
        sampled tokens' log-probs."""
        body = {
            "model": self.model_id,
            "prompt": prompt_ids,
            "return_token_ids": True,
            "skip_special_tokens": False,
            **params,
        }
        answer = self.request("POST", "/v1/completions", body)
        choice = answer["choices"][0]
        ids = list(choice.get("token_ids") or [])
        logprobs = None
        if params.get("logprobs") is not None and choice.get("logprobs"):
            logprobs = [float(v) for v in choice["logprobs"]["token_logprobs"]]
        return ids, logprobs

    # ---- vLLM's RL routes -----------------------------------------------------------------------

    def pause(self, mode: str = "wait") -> None:
        """Stop scheduling new requests (``wait``: the running ones finish first); caches are cleared."""
        self.request("POST", "/pause", query={"mode": mode, "clear_cache": "true"})

    def resume(self) -> None:
        self.request("POST", "/resume")

    def is_paused(self) -> bool:
        return bool(self.request("GET", "/is_paused")["is_paused"])

    def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        self.request("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.request("POST", "/start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.request("POST", "/update_weights", {"update_info": update_info})

    def finish_weight_update(self, version: str | None = None) -> None:
        self.request(
            "POST", "/finish_weight_update", None if version is None else {"weight_version": version}
        )

    def weight_version(self) -> str | None:
        return self.request("GET", "/weight_info").get("weight_version")


def address_towards(host: str, port: int) -> str:
    """This machine's address on the route to ``host:port`` (what a server there reaches the trainer at)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((host, port))
            return str(sock.getsockname()[0])
        except OSError:
            return "127.0.0.1"
