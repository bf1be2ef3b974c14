"""vLLM servers as a generation backend (``use_vllm=True, vllm_mode="server"``).

Generation runs in one or more separate ``vllm serve`` processes (``rlhf-trainers vllm-serve`` starts one
with what training needs), on other devices or machines; the trainer sends token ids to their OpenAI
completions route and gets token ids and log-probs back (nothing is detokenized and re-tokenized). The
rows of a rollout are spread over the servers in contiguous blocks (a prompt's group stays on one server,
whose prefix cache then holds the prompt once), one request per row with a seed of its own drawn from
torch's global generator, as the colocated engine does.

After the policy's weights change, the next generation first pushes them to every server through vLLM's
weight-transfer API (:mod:`rlhf_trainers.generation.weight_transfer`: the gloo engine; the whole model,
LoRA adapters merged, ZeRO-3 gathered module by module): each server is paused (no request runs while its
weights change), updated, and resumed. A sync that fails half way leaves that server paused, so it never
serves a mix of old and new weights; it is retried in full once, then the run stops with an error that
names the server. In a multi-process run the first process syncs and the others wait for it. With
``vllm_lora_sync="adapter"`` only the LoRA adapter travels, as a vLLM LoRA adapter the servers load from a
shared folder (:mod:`rlhf_trainers.generation.lora_adapter_sync`).

Checked when the backend is built: every server answers within ``vllm_server_timeout``, serves a model of
the policy's architecture and sizes (else refused before any weight is sent), with vLLM's processed
log-probs and the gloo weight-transfer engine, and holds the longest prompt + response.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from .base import (
    GenerationError,
    Samples,
    SamplingSettings,
    WeightSyncs,
    on_any_process,
    request_seeds,
)
from .lora_adapter_sync import AdapterPublisher
from .server_client import START_A_SERVER, ServerError, VLLMServerClient, address_towards
from .weight_transfer import BACKEND, GlooSender, model_signature, port_or_free
from .weights import inference_weights, untied_by_adapters

__all__ = ["VLLMServer", "server_urls"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def server_urls(base_url: str | Sequence[str] | None, host: str, port: int) -> list[str]:
    """The servers' URLs: ``base_url`` (one URL, a comma-separated list, or a list), else
    ``http://host:port``."""
    if base_url is None or base_url == "" or base_url == []:
        return [f"http://{host}:{port}"]
    items = base_url.split(",") if isinstance(base_url, str) else list(base_url)
    urls = [u.strip() for u in items if u and u.strip()]
    bad = [u for u in urls if not u.startswith(("http://", "https://"))]
    if not urls or bad:
        raise ValueError(
            f"vllm_server_base_url={base_url!r}: expected one URL (http://host:port) or a comma-separated list."
        )
    return urls


class VLLMServer(WeightSyncs):
    """A :class:`~rlhf_trainers.generation.GenerationBackend` that samples from vLLM servers.

    Args:
        model: the policy (unwrapped; a transformers causal LM or a PEFT model around one).
        urls: the servers (``http://host:port``).
        weights_version: returns a value that changes whenever the policy's weights may have changed; the
            servers are synced before the next generation when it differs from the value at the last sync.
        timeout_s: seconds to wait for a server to come up, and for any one request.
        group_port: the first port of the trainer's weight-transfer stores (server i uses ``group_port + i``;
            0: free ports).
        process_index: this process's rank; the first process (0) syncs the weights.
        num_processes: the training processes (the others wait at a barrier while the first syncs).
        longest_sequence: the longest prompt + response the servers must hold.
        lora_sync: ``"merged"``: the LoRA adapter (if any) merged into every weight sent; ``"adapter"``: only
            the adapter, written to ``lora_dir`` and loaded by each server as a vLLM LoRA adapter
            (:mod:`~rlhf_trainers.generation.lora_adapter_sync`).
        lora_dir: with ``lora_sync="adapter"``: a folder the servers can read (a shared filesystem).
    """

    logprobs_for_rollout = False
    batches_internally = True
    #: Generation runs in other processes: asynchronous rollouts overlap it with training.
    generates_elsewhere = True

    def __init__(
        self,
        model: nn.Module,
        urls: Sequence[str],
        *,
        weights_version: Callable[[], Hashable],
        timeout_s: float = 240.0,
        group_port: int = 0,
        process_index: int = 0,
        num_processes: int = 1,
        longest_sequence: int | None = None,
        lora_sync: str = "merged",
        lora_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if untied_by_adapters(model):
            raise ValueError(
                "vllm_mode='server': the LoRA adapter on the tied input embedding or lm head makes them two "
                "matrices, which a server built from the base checkpoint holds as one; leave the embedding and "
                "lm head out of target_modules, or use vllm_mode='colocate'."
            )
        self.model = model
        self.adapter: AdapterPublisher | None = None
        if lora_sync == "adapter":
            if lora_dir is None:
                raise ValueError(
                    "vllm_lora_sync='adapter' needs vllm_lora_dir (a folder the servers can read)."
                )
            self.adapter = AdapterPublisher(model, lora_dir, write=process_index == 0)
        WeightSyncs.__init__(self, weights_version)  # syncs, their seconds, the synced version
        self._base_sent = False
        self.process_index = process_index
        self.num_processes = num_processes
        self.clients = [VLLMServerClient(url, timeout_s) for url in urls]
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="vllm-server")
        started = time.perf_counter()
        for client in self.clients:
            client.wait_until_up(timeout_s)
        self.descriptions = [self._check(client, longest_sequence) for client in self.clients]
        dtypes = {d["dtype"] for d in self.descriptions}
        if len(dtypes) != 1:
            raise ValueError(
                f"vllm_mode='server': the servers hold different dtypes {sorted(dtypes)}; start them alike."
            )
        self.dtype = _DTYPES.get(dtypes.pop(), torch.float32)
        self.senders: list[GlooSender] = []
        if self.adapter is not None:
            for client, description in zip(self.clients, self.descriptions, strict=True):
                self.adapter.check_server(client, description["lora"])
        if process_index == 0:
            # names, dtypes and shapes of what is sent, in order: the same at every sync
            self._manifest = [
                (name, str(self._wire(t).dtype).removeprefix("torch."), list(t.shape))
                for name, t in inference_weights(model)
            ]
            for i, client in enumerate(self.clients):
                self.senders.append(self._connect(client, group_port + i if group_port else 0, timeout_s))
        else:
            for _ in inference_weights(model):  # ZeRO-3: the gathers are collectives, all processes join
                pass
        # the groups are closed with the backend (another trainer of this process may reuse the ports)
        self._finalizer = weakref.finalize(self, _close_senders, list(self.senders))
        self.build_seconds = time.perf_counter() - started
        where = ", ".join(c.base_url for c in self.clients)
        self.name = f"vllm server ({where}, {str(self.dtype).removeprefix('torch.')})"
        self.summary = f"vLLM server{'s' if len(self.clients) > 1 else ''} at {where}"

    # ---- construction checks --------------------------------------------------------------------

    def _check(self, client: VLLMServerClient, longest_sequence: int | None) -> dict[str, Any]:
        """What ``client`` serves, refused unless training can use it."""
        description = client.describe()
        if description["weight_transfer_backend"] != BACKEND:
            raise ValueError(
                f"vllm_mode='server': the vLLM server at {client.base_url} has weight transfer "
                f"{description['weight_transfer_backend']!r}; training syncs weights with the {BACKEND!r} engine: "
                f"{START_A_SERVER}."
            )
        if description["logprobs_mode"] not in (None, "processed_logprobs"):
            raise ValueError(
                f"vllm_mode='server': the vLLM server at {client.base_url} returns {description['logprobs_mode']} "
                "log-probs; the trainer compares its own with the sampler's after the temperature "
                f"(--logprobs-mode processed_logprobs): {START_A_SERVER}."
            )
        if longest_sequence is not None and client.max_model_len is not None:
            if longest_sequence > client.max_model_len:
                raise ValueError(
                    f"vllm_mode='server': the longest prompt + response_length = {longest_sequence} tokens exceeds "
                    f"the context of the vLLM server at {client.base_url} ({client.max_model_len} tokens); start it "
                    f"with --max-model-len {longest_sequence} or more, or lower max_prompt_length."
                )
        try:
            served = client.collective_rpc("rlhf_trainers_model_signature")
        except ServerError as err:
            raise ValueError(
                f"vllm_mode='server': the vLLM server at {client.base_url} lacks rlhf_trainers' worker extension "
                f"({err}); {START_A_SERVER}."
            ) from err
        root = (
            self.model.get_base_model()
            if callable(getattr(self.model, "get_base_model", None))
            else self.model
        )
        ours = model_signature(root.config)
        for theirs in served:
            diff = {k: (ours[k], theirs.get(k)) for k in ours if ours[k] != theirs.get(k)}
            if diff:
                shown = ", ".join(f"{k}: policy {a!r} vs server {b!r}" for k, (a, b) in diff.items())
                raise ValueError(
                    f"vllm_mode='server': the vLLM server at {client.base_url} serves another model "
                    f"({description['root']}): {shown}. Start it with the policy's checkpoint."
                )
        return description

    def _connect(self, client: VLLMServerClient, port: int, timeout_s: float) -> GlooSender:
        """Join a weight-transfer group with ``client``'s workers (its init call runs on a side thread: the
        workers block in it until every rank joined)."""
        host = address_towards(client.host, client.port)
        sender = GlooSender(host, port_or_free(host, port), 1 + client.world_size(), timeout_s)
        errors: list[BaseException] = []

        def init() -> None:
            try:
                client.init_weight_transfer(sender.init_info())
            except BaseException as err:  # reported by the caller
                errors.append(err)

        thread = threading.Thread(target=init, name="vllm-weight-transfer-init", daemon=True)
        thread.start()
        try:
            sender.join()
        except Exception as err:
            thread.join(timeout=5)
            cause = f" (the server said: {errors[0]})" if errors else ""
            raise ServerError(
                f"vllm_mode='server': joining the weight-transfer group of the vLLM server at {client.base_url} "
                f"failed: {err}{cause}. The server must reach this machine at {host}:{sender.port} "
                "(vllm_group_port)."
            ) from err
        thread.join()
        if errors:
            raise errors[0]
        return sender

    # ---- weights --------------------------------------------------------------------------------

    def _wire(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(dtype=self.dtype) if tensor.is_floating_point() else tensor

    def sync_weights(self) -> float:
        """Push the policy's current weights to every server (the first process sends; ZeRO-3 gathers on
        all). Returns the seconds taken."""
        with self.syncing():  # stale until every server has the whole model
            if self.adapter is None:
                self._push_weights()
            else:
                if not self._base_sent:  # the servers may hold other base weights (an earlier run's sync)
                    with self.model.disable_adapter():
                        self._push_weights()
                    self._base_sent = True
                self._push_adapter(self.adapter)
            if self.num_processes > 1 and torch.distributed.is_initialized():
                torch.distributed.barrier()  # nobody generates before every server has the new weights
        return self.last_sync_seconds

    def _push_weights(self) -> None:
        """Every weight to every server (the first process sends; ZeRO-3 gathers on all)."""
        if self.process_index == 0:
            for client, sender in zip(self.clients, self.senders, strict=True):
                self._push(client, sender, f"{self.syncs + 1}")
        else:
            for _ in inference_weights(self.model):
                pass

    def _push(self, client: VLLMServerClient, sender: GlooSender, version: str) -> None:
        """One server: pause, send every weight, finish, resume; retried once in full. A server whose sync
        failed stays paused (it never serves a mix of weights)."""
        client.pause("wait")
        for attempt in (1, 2):
            try:
                self._send(client, sender, version)
                break
            except Exception as err:
                if attempt == 2:
                    raise GenerationError(
                        f"vllm_mode='server': syncing the policy's weights into the vLLM server at {client.base_url} "
                        f"failed twice ({type(err).__name__}: {err}). The server is left paused, so it serves no "
                        "mix of old and new weights; restart it and resume the run from its last checkpoint."
                    ) from err
        client.resume()

    def _push_adapter(self, adapter: AdapterPublisher) -> None:
        """Adapter-only: write the adapter's new version (every process joins ZeRO-3's gathers), and have
        each server load it while paused (no request runs across the change)."""
        path = adapter.publish()
        if path is None:
            return
        for client in self.clients:
            client.pause("wait")
            try:
                adapter.load(client, path)
            except Exception as err:  # the previous version stays loaded: resume on it, and stop
                client.resume()
                raise GenerationError(
                    f"vllm_mode='server': the vLLM server at {client.base_url} did not load the LoRA adapter "
                    f"{path} ({err}). It must read vllm_lora_dir at the same path (a shared filesystem)."
                ) from err
            client.resume()
        adapter.prune()

    def _send(self, client: VLLMServerClient, sender: GlooSender, version: str) -> None:
        """One update session on ``client``: every weight, in the manifest's order. If this side fails half
        way (making a weight, or sending it), the rest of the stream is sent as zeros so that the server's
        workers, which block until they received every announced tensor, finish it; the session is then
        closed without a version and the error raised: the server, still paused, holds a mix that the retry
        overwrites whole."""
        update_info = {
            "names": [name for name, _, _ in self._manifest],
            "dtype_names": [dtype for _, dtype, _ in self._manifest],
            "shapes": [shape for _, _, shape in self._manifest],
        }
        client.start_weight_update()
        errors: list[BaseException] = []

        def update() -> None:
            try:
                client.update_weights(update_info)
            except BaseException as err:
                errors.append(err)

        thread = threading.Thread(target=update, name="vllm-update-weights", daemon=True)
        thread.start()
        sent = 0
        failure: Exception | None = None
        try:
            for name, tensor in inference_weights(self.model):
                if sent >= len(self._manifest) or name != self._manifest[sent][0]:
                    raise GenerationError(
                        f"the policy's weight {name!r} (number {sent + 1}) is not the one the first sync sent "
                        "there: its parameters changed since the backend was built."
                    )
                sender.send([self._wire(tensor)])
                sent += 1
        except Exception as err:
            failure = err
        if failure is None and sent < len(self._manifest):
            failure = GenerationError(
                f"the policy has {sent} weights, the first sync sent {len(self._manifest)}: its parameters "
                "changed since the backend was built."
            )
        if failure is not None:
            for _, dtype, shape in self._manifest[sent:]:  # keep the server's workers in step
                sender.send([torch.zeros(shape, dtype=getattr(torch, dtype))])
        thread.join(timeout=sender.timeout_s)
        if thread.is_alive():
            raise GenerationError(
                f"the vLLM server at {client.base_url} did not take the weights within {sender.timeout_s:g} s "
                "(vllm_server_timeout)."
            )
        if errors:
            raise errors[0]
        client.finish_weight_update(None if failure is not None else version)
        if failure is not None:
            raise failure

    def sync_if_stale(self) -> None:
        """Sync the servers when the policy's weights may have changed since the last sync (any process's:
        under several processes a collective, so every process calls it)."""
        if on_any_process(self.is_stale(), self.num_processes > 1 and torch.distributed.is_initialized()):
            self.sync_weights()

    # ---- sampling -------------------------------------------------------------------------------

    @torch.no_grad()
    def sample(
        self,
        query_ids: torch.Tensor,
        query_mask: torch.Tensor,
        settings: SamplingSettings,
        *,
        sync: bool = True,
    ) -> Samples:
        """See :meth:`GenerationBackend.sample`: one request per row (its own seed, its
        ``settings.row_max_new_tokens`` as ``max_tokens``), rows spread over the servers in contiguous
        blocks; log-probs are the server's (after the temperature), entropies are not available (None).
        ``sync=False``: with the servers' weights as they are (asynchronous rollouts call it so from another
        thread, after syncing on theirs)."""
        rows = [
            ids[mask.bool()].tolist() for ids, mask in zip(query_ids.cpu(), query_mask.cpu(), strict=True)
        ]
        limits = list(settings.row_max_new_tokens or [settings.max_new_tokens] * len(rows))
        try:
            if sync:
                self.sync_if_stale()
        except GenerationError:
            raise
        except Exception as err:
            raise GenerationError(f"vllm_mode='server': syncing the policy's weights failed: {err}") from err
        seeds = request_seeds(len(rows), settings.seed)
        block = -(-len(rows) // len(self.clients)) if rows else 1
        futures = []
        for i, (row, limit, seed) in enumerate(zip(rows, limits, seeds, strict=True)):
            params = {
                "max_tokens": limit,
                "temperature": settings.temperature,
                "top_p": settings.top_p,
                "top_k": settings.top_k,
                "min_p": settings.min_p,
                "seed": seed,
                "ignore_eos": True,  # only the trainer's stop tokens end a row
                "stop_token_ids": list(settings.stop_token_ids),
                "logprobs": 0 if settings.return_logprobs else None,
                **self._model_field(),
            }
            futures.append(self._pool.submit(self.clients[i // block].complete, row, params))
        width = settings.max_new_tokens
        tokens = torch.full((len(rows), width), settings.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros(len(rows), width) if settings.return_logprobs else None
        for i, future in enumerate(futures):
            try:
                ids, values = future.result()
            except ServerError as err:
                for other in futures:
                    other.cancel()
                raise GenerationError(f"vllm_mode='server': generation failed: {err}") from err
            ids = ids[:width]
            if ids:
                tokens[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            if logprobs is not None and values is not None:
                values = values[: len(ids)]
                logprobs[i, : len(values)] = torch.tensor(values, dtype=torch.float32)
        device = query_ids.device
        return Samples(tokens.to(device), logprobs.to(device) if logprobs is not None else None, None)

    def _model_field(self) -> dict[str, str]:
        """Adapter-only sync: completions name the adapter, which vLLM applies on the base weights."""
        return {} if self.adapter is None else {"model": self.adapter.lora_name}

    def completion_logprobs(
        self, prompts: list[list[int]], completions: list[list[int]], server: int = 0
    ) -> list[torch.Tensor]:
        """Server number ``server``'s log-probs of given ``completions`` after ``prompts`` under
        ``softmax(logits)`` (temperature 1), one float32 tensor per row; the weights are synced first if they
        changed. For checking a server against the trainer's forward pass."""
        self.sync_if_stale()
        client = self.clients[server]
        result = []
        for prompt, completion in zip(prompts, completions, strict=True):
            body = {
                "model": client.model_id,
                **self._model_field(),
                "prompt": list(prompt) + list(completion),
                "max_tokens": 1,
                "temperature": 1.0,
                "prompt_logprobs": 0,
                "return_token_ids": True,
            }
            answer = client.request("POST", "/v1/completions", body)
            steps = answer["choices"][0]["prompt_logprobs"][len(prompt) :]
            result.append(
                torch.tensor([step[str(t)]["logprob"] for step, t in zip(steps, completion, strict=True)])
            )
        return result

    def close(self) -> None:
        """Release the weight-transfer groups and the request threads (the servers keep running)."""
        self._finalizer()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _close_senders(senders: list[GlooSender]) -> None:
    for sender in senders:
        sender.close()
