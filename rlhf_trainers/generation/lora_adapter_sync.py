"""Adapter-only weight sync to vLLM servers (``vllm_lora_sync="adapter"``): instead of the LoRA adapter merged
into every base weight, only the adapter travels. The trainer writes it as a PEFT adapter folder (a few MB
instead of the whole model) into ``vllm_lora_dir``, a folder the servers read too, and each server loads it
with vLLM's own runtime-LoRA route (``/v1/load_lora_adapter``, on under ``--enable-lora`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``: ``rlhf-trainers vllm-serve --enable_lora``); completions then name
the adapter as their model, so vLLM applies it on the base weights it already holds.

The first sync also sends the base weights once, with the adapter disabled, through the weight transfer
of a full sync (the servers may hold another run's weights); later syncs send the adapter alone.

Every sync writes a new folder (``v<N>``): vLLM keys its prefix cache on the adapter's path, so a new path
keeps blocks computed under older weights from being reused. Folders older than the one just loaded are
removed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..distributed import gathered
from .server_client import VLLMServerClient

__all__ = ["AdapterPublisher", "adapter_of"]

#: vLLM's own LoRA layers have no DoRA and no trained copies of whole modules.
_UNSUPPORTED = (
    ("use_dora", "DoRA (use_dora=True)"),
    ("modules_to_save", "modules_to_save (whole trained modules, not low-rank deltas)"),
)


def adapter_of(model: nn.Module) -> tuple[str, Any]:
    """The active adapter's name and PEFT config of ``model``.

    Raises:
        ValueError: ``model`` is not a PEFT LoRA model, or its adapter has what vLLM's LoRA cannot apply.
    """
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not configs or not callable(getattr(model, "disable_adapter", None)):
        raise ValueError(
            "vllm_lora_sync='adapter' syncs a LoRA adapter, and the policy has none: pass peft_config= "
            "(a LoraConfig), or use vllm_lora_sync='merged'."
        )
    name = getattr(model, "active_adapter", None) or next(iter(configs))
    config = configs[name]
    if str(getattr(config, "peft_type", "")).rsplit(".", 1)[-1].upper() != "LORA":
        raise ValueError(
            f"vllm_lora_sync='adapter': the policy's adapter is {config.peft_type}, and vLLM serves LoRA "
            "adapters only; use vllm_lora_sync='merged'."
        )
    for field, words in _UNSUPPORTED:
        if getattr(config, field, None):
            raise ValueError(
                f"vllm_lora_sync='adapter': the adapter uses {words}, which vLLM's LoRA cannot apply; drop it "
                "from the LoraConfig, or use vllm_lora_sync='merged' (the adapter merged into the weights)."
            )
    return name, config


class AdapterPublisher:
    """Writes the policy's LoRA adapter for vLLM servers and has them load it.

    Args:
        model: the PEFT policy (unwrapped).
        folder: where adapter versions are written; the servers must read the same path.
        write: whether this process writes and loads (the first process); the others only join the gathers
            of partitioned (ZeRO-3) adapter weights.
    """

    def __init__(self, model: nn.Module, folder: str | os.PathLike[str], *, write: bool) -> None:
        self.model = model
        self.adapter_name, self.config = adapter_of(model)
        self.folder = Path(folder).resolve()
        self.write = write
        #: The adapter's name on the servers, the same on every process (from the folder's path) and
        #: distinct for trainers that write to distinct folders.
        self.lora_name = "rlhf-" + hashlib.sha1(str(self.folder).encode()).hexdigest()[:12]
        self.rank = int(self.config.r)
        self.version = 0
        outside = [n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n]
        if outside:
            shown = ", ".join(outside[:4])
            raise ValueError(
                f"vllm_lora_sync='adapter': the policy trains weights outside the LoRA adapter ({shown}...), "
                "which an adapter-only sync would never send; freeze them, or use vllm_lora_sync='merged'."
            )

    def check_server(self, client: VLLMServerClient, lora: dict[str, Any] | None) -> None:
        """Refuse a server without runtime LoRA, or whose largest rank is below the adapter's."""
        if lora is None:
            raise ValueError(
                f"vllm_lora_sync='adapter': the vLLM server at {client.base_url} has LoRA off; start it with "
                f"`rlhf-trainers vllm-serve --enable_lora --max_lora_rank {max(self.rank, 8)}`."
            )
        largest = lora.get("max_lora_rank")
        if largest is not None and int(largest) < self.rank:
            raise ValueError(
                f"vllm_lora_sync='adapter': the adapter's rank r={self.rank} exceeds the vLLM server at "
                f"{client.base_url}'s --max-lora-rank {largest}; restart it with --max_lora_rank {self.rank} "
                "or more."
            )

    @torch.no_grad()
    def _state(self) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        lora = [p for n, p in self.model.named_parameters() if "lora_" in n]
        with gathered(*lora):  # ZeRO-3: every process joins; the first writes
            state = get_peft_model_state_dict(self.model, adapter_name=self.adapter_name)
            return {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in state.items()}

    def publish(self) -> Path | None:
        """Write the adapter's current weights as a new version folder (atomically: a temporary folder
        renamed); its path on the writing process, None on the others."""
        state = self._state()
        if not self.write:
            return None
        from safetensors.torch import save_file

        self.version += 1
        final = self.folder / f"v{self.version}"
        temporary = self.folder / f".v{self.version}.tmp-{os.getpid()}"
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir(parents=True)
        save_file(state, str(temporary / "adapter_model.safetensors"), metadata={"format": "pt"})
        self.config.save_pretrained(str(temporary))  # adapter_config.json
        shutil.rmtree(final, ignore_errors=True)
        os.replace(temporary, final)
        return final

    def load(self, client: VLLMServerClient, path: Path) -> None:
        """Have ``client``'s server load the adapter at ``path`` under :attr:`lora_name` (in place of the
        previous version)."""
        client.request(
            "POST",
            "/v1/load_lora_adapter",
            {"lora_name": self.lora_name, "lora_path": str(path), "load_inplace": True},
        )

    def prune(self) -> None:
        """Remove the version folders older than the last one written."""
        if not self.write or not self.folder.is_dir():
            return
        for old in self.folder.glob("v*"):
            number = old.name[1:]
            if number.isdigit() and int(number) < self.version:
                shutil.rmtree(old, ignore_errors=True)
