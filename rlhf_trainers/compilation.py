"""``torch_compile=True`` for the on-policy trainers: regional compilation of the models' repeated blocks.

transformers' ``Trainer`` answers ``torch_compile=True`` by handing the whole model to ``torch.compile``
through accelerate. For an RLHF engine that is the wrong unit: the same model is called for sampling (with
a KV cache, one token at a time), for padded and packed scoring passes without gradients, and for
training passes, each with other shapes, and a whole-model graph is recompiled for each of them (on the
kit, a 3-update RLOO run took 73 s instead of 0.15 s). The engine compiles instead each **repeated block**
(the decoder layers: the classes a model lists in ``_no_split_modules``, else the children of its longest
:class:`~torch.nn.ModuleList` of one class), with dynamic shapes, so one compiled graph serves every layer
of every model of that class and every sequence length. The block's matrix products still run on the
library kernels; what the compiler can earn is the fusion of the element-wise work between them
(normalization, rotary embeddings, the gated activation, residual additions, and their backward). On the
2-core Intel Xeon it measured no gain, on the 2-core AMD EPYC 4-7 % of a SmolLM2-135M PPO update
(docs/ppo.md, "Compilation").

The compiled blocks are used only inside the engine's passes (:meth:`CompiledBlocks.active`); outside
them, and while sampling (:meth:`CompiledBlocks.paused`), the models run eager: a decoding step is a few
tokens wide, and the KV cache's per-layer bookkeeping would make the compiler specialize every layer.
Attention implementations that cannot be traced (the one-row packed pass's per-sequence attention,
:mod:`rlhf_trainers.packing`) are excluded from the graphs and run eager between them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["CompiledBlocks", "repeated_blocks", "uncompiled"]


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model`` (a transformers model, possibly wrapped by PEFT or a value head):
    the modules whose class the model names in ``_no_split_modules`` (transformers' list of the blocks
    that must not be split across devices: its decoder layers), else the children of its longest
    :class:`~torch.nn.ModuleList` whose children all share one class. Empty when neither exists."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if blocks:
        return blocks
    lists = [
        m
        for m in model.modules()
        if isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(c) for c in m}) == 1
    ]
    return list(max(lists, key=len)) if lists else []


class CompiledBlocks:
    """The :func:`repeated_blocks` of some models, compiled (``torch.compile`` with dynamic shapes,
    ``backend`` default ``"inductor"``, ``mode``) and used only inside :meth:`active`: outside it the
    models run eager, as they were given (a user's ``model.generate()`` after training is not compiled).
    The blocks are compiled as ``nn.Module.compile`` does it (the module's call compiled in place, shared
    code for every block of a class; parameters and state-dict keys unchanged), at their first call inside
    :meth:`active`. :meth:`paused` runs a part of an active region eager (sampling)."""

    def __init__(
        self, models: Iterable[nn.Module | None], *, backend: str | None = None, mode: str | None = None
    ) -> None:
        self.blocks: list[nn.Module] = []
        seen: set[int] = set()
        for model in models:
            for block in repeated_blocks(model) if model is not None else ():
                if id(block) not in seen:
                    seen.add(id(block))
                    self.blocks.append(block)
        self._compiled = [
            torch.compile(block._call_impl, backend=backend or "inductor", mode=mode, dynamic=True)
            for block in self.blocks
        ]

    def __len__(self) -> int:
        return len(self.blocks)

    def _switch(self, impls: list[Any]) -> list[Any]:
        previous = [block._compiled_call_impl for block in self.blocks]
        for block, impl in zip(self.blocks, impls, strict=True):
            block._compiled_call_impl = impl
        return previous

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Inside the context the blocks run compiled; after it, as before (also after an exception)."""
        previous = self._switch(self._compiled)
        try:
            yield
        finally:
            self._switch(previous)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside the context the blocks run eager (a decoding step is a few tokens wide, and the KV
        cache's per-layer bookkeeping would specialize the graph to every layer); after it, as before."""
        previous = self._switch([None] * len(self.blocks))
        try:
            yield
        finally:
            self._switch(previous)


def uncompiled(fn: Any) -> Any:
    """``fn`` run outside any compiled graph (``torch.compiler.disable``): for code the compiler cannot
    trace, called from inside a compiled block (a graph break around it instead of a failed trace)."""
    return torch.compiler.disable(fn)
