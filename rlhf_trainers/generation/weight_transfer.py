"""Weight transfer from the trainer to vLLM servers over gloo: both ends of vLLM's weight-transfer API.

vLLM 0.32's RL API moves weights from a trainer into a running ``vllm serve`` (routes
``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``
under ``VLLM_SERVER_DEV_MODE=1``); the transport is a *weight-transfer engine* chosen by the server's
``--weight-transfer-config``. vLLM ships NCCL and CUDA-IPC engines (GPUs only). This module adds a gloo
engine, registered with vLLM's ``WeightTransferEngineFactory`` under the name ``"gloo"``, so the same
protocol runs between CPU processes and across machines without GPUs (on GPUs too, through host memory).

The server side (:class:`GlooWorkerExtension`, given to ``vllm serve --worker-extension-cls``, which
``rlhf-trainers vllm-serve`` does) imports this module inside vLLM's worker process, which registers the
engine before the worker builds it. The trainer side (:class:`GlooSender`) needs torch only, no vLLM.

The protocol of one update, as vLLM's own NCCL engine runs it (the trainer is rank 0 of a process group
with the server's workers, ranks 1..n, and hosts its store):

1. once: ``/init_weight_transfer_engine`` with ``{"master_address", "master_port", "world_size",
   "rank_offset"}``, sent from a side thread while the trainer joins the group (the server's worker blocks in
   the call until every rank joined);
2. per update: ``/start_weight_update`` (vLLM's layerwise reload begins), then ``/update_weights`` with the
   names, dtypes and shapes of every weight, sent from a side thread while the trainer broadcasts the
   tensors one by one in that order, then ``/finish_weight_update`` (each layer is re-processed: on CPU its
   matmul kernels are packed again from the new weights).

Every weight of the model is sent at every update: vLLM's layerwise reload fills a layer whose weights did
not all arrive with uninitialized memory. Tensors travel as bytes (a ``uint8`` view), so any dtype crosses
gloo unchanged.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "BACKEND",
    "SIGNATURE_KEYS",
    "GlooInitInfo",
    "GlooSender",
    "GlooUpdateInfo",
    "GlooWorkerExtension",
    "gloo_group",
    "model_signature",
    "port_or_free",
    "register",
    "repack_tied_lm_head",
]

#: The name of the engine in vLLM's factory (``--weight-transfer-config '{"backend": "gloo"}'``).
BACKEND = "gloo"


def gloo_group(
    host: str, port: int, rank: int, world_size: int, timeout_s: float
) -> tuple[Any, torch.distributed.TCPStore]:
    """A gloo process group of ``world_size`` ranks outside torch.distributed's default group (the trainer's
    own, under DDP, is left alone): rank 0 hosts a TCP store at ``host:port``, the others connect to it.
    Returns the group (a ``ProcessGroupGloo``) and the store, which must outlive it."""
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    timeout = datetime.timedelta(seconds=timeout_s)
    store = TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    group = ProcessGroupGloo(PrefixStore("rlhf-trainers-weights", store), rank, world_size, timeout)
    return group, store


def _broadcast(group: Any, tensor: torch.Tensor) -> None:
    """Broadcast ``tensor`` (contiguous, on the CPU) from rank 0 of ``group``, as bytes."""
    from torch.distributed import BroadcastOptions

    options = BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    group.broadcast([tensor.view(-1).view(torch.uint8)], options).wait()


@dataclass
class GlooInitInfo:
    """What ``/init_weight_transfer_engine`` carries for the gloo engine."""

    #: Where the trainer's store listens (an address the server's workers reach).
    master_address: str
    master_port: int
    #: 1 (the trainer) + the server's workers.
    world_size: int
    #: The group rank of the server's first worker (the trainer is 0).
    rank_offset: int = 1
    #: Seconds any rank waits for the others (joining, each broadcast).
    timeout_s: float = 600.0


@dataclass
class GlooUpdateInfo:
    """What ``/update_weights`` carries: the weights the trainer broadcasts next, in order."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes must be as long as each other; got {len(self.names)}, "
                f"{len(self.dtype_names)} and {len(self.shapes)}."
            )


def _engine_class() -> type:
    """The server-side engine (a subclass of vLLM's ``WeightTransferEngine``; vLLM imported here only)."""
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    class GlooWeightTransferEngine(WeightTransferEngine):  # type: ignore[misc,valid-type]
        """Receives the trainer's weights over a gloo group and loads them with vLLM's layerwise reload."""

        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo
        supports_draft_weight_update = False

        def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: Any) -> None:
            super().__init__(config, vllm_config, device, model)
            self.group: Any = None
            self.store: Any = None

        def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
            from vllm.distributed import get_world_group

            rank = init_info.rank_offset + get_world_group().rank
            self.group, self.store = gloo_group(
                init_info.master_address,
                init_info.master_port,
                rank,
                init_info.world_size,
                init_info.timeout_s,
            )

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)
            repack_tied_lm_head(self.model)

        def receive_weights(self, update_info: GlooUpdateInfo) -> None:
            if self.group is None:
                raise RuntimeError(
                    "gloo weight transfer not initialized: call /init_weight_transfer_engine first."
                )
            for name, dtype_name, shape in zip(
                update_info.names, update_info.dtype_names, update_info.shapes, strict=True
            ):
                weight = torch.empty(shape, dtype=getattr(torch, dtype_name))
                _broadcast(self.group, weight)
                self.model.load_weights([(name, weight.to(self.device))])

        def shutdown(self) -> None:
            self.group = None
            self.store = None

    return GlooWeightTransferEngine


def register() -> None:
    """Register the gloo engine with vLLM's factory (in the process that builds engines: vLLM's worker).
    Safe to call more than once."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, _engine_class())
    except ValueError:  # registered already (an earlier import in this process)
        pass


#: The model config fields a server's model must share with the trainer's (checked before the first sync).
SIGNATURE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
)


def model_signature(config: Any) -> dict[str, Any]:
    """The :data:`SIGNATURE_KEYS` of a transformers model config (its text config where it nests one)."""
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    return {key: getattr(text, key, None) for key in SIGNATURE_KEYS}


def repack_tied_lm_head(model: Any) -> None:
    """Re-run the post-load processing of a vLLM model's lm head tied to its input embedding.

    A tied head receives no weights of its own (checkpoints hold the shared tensor once, under the
    embedding's name), so vLLM's reload leaves it unprocessed: on CPU it keeps the matmul kernel it packed
    from the old weights (measured with the colocated engine: log-probs off by 0.4 after the embedding
    changed). Processing it again repacks the new weights; on GPU, where the head reads the shared weight
    directly, it is a no-op."""
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return
    for module in model.modules():
        if type(module).__name__ == "ParallelLMHead" and hasattr(module, "quant_method"):
            module.quant_method.process_weights_after_loading(module)


class GlooWorkerExtension:
    """Given to ``vllm serve --worker-extension-cls rlhf_trainers.generation.weight_transfer.GlooWorkerExtension``:
    vLLM imports it in every worker before the model loads, which registers the gloo engine there, and
    adds :meth:`rlhf_trainers_model_signature` to the worker (called through ``/collective_rpc``)."""

    def rlhf_trainers_model_signature(self) -> dict[str, Any]:
        """The served model's :func:`model_signature` (the trainer compares it with its policy's)."""
        return model_signature(self.vllm_config.model_config.hf_config)  # type: ignore[attr-defined]


def _register_if_in_vllm() -> None:
    import sys

    if "vllm" in sys.modules:  # imported by vLLM's worker (the extension), not by a trainer
        register()


_register_if_in_vllm()


class GlooSender:
    """The trainer's end: rank 0 of a gloo group with one server's workers.

    Args:
        host: the trainer's address as the server reaches it (the store listens there).
        port: the store's port (0: any free one).
        world_size: 1 + the server's workers.
        timeout_s: seconds to wait for the server's workers to join and for each broadcast.
    """

    def __init__(self, host: str, port: int, world_size: int, timeout_s: float) -> None:
        self.host = host
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.port = port or _free_port(host)
        self.group: Any = None
        self.store: Any = None

    def init_info(self) -> dict[str, Any]:
        """The body of ``/init_weight_transfer_engine``."""
        return {
            "master_address": self.host,
            "master_port": self.port,
            "world_size": self.world_size,
            "rank_offset": 1,
            "timeout_s": self.timeout_s,
        }

    def join(self) -> None:
        """Host the store and join the group (blocks until the server's workers joined)."""
        self.group, self.store = gloo_group(self.host, self.port, 0, self.world_size, self.timeout_s)

    def send(self, tensors: Iterable[torch.Tensor]) -> None:
        """Broadcast ``tensors`` in order (each made contiguous on the CPU first)."""
        for tensor in tensors:
            _broadcast(self.group, tensor.detach().to("cpu").contiguous())

    def close(self) -> None:
        self.group = None
        self.store = None


def _free_port(host: str) -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_or_free(host: str, port: int) -> int:
    """``port`` if nothing listens on it at ``host``, else a free port (with a warning: an earlier trainer
    of this process, or another job, holds it). 0: a free port."""
    import logging
    import socket

    if port == 0:
        return _free_port(host)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            free = _free_port(host)
            logging.getLogger(__name__).warning(
                "vllm_group_port: port %d is taken on %s (an earlier trainer's weight transfer, or another "
                "job); the weight transfer listens on %d instead.",
                port,
                host,
                free,
            )
            return free
    return port
