"""A kit agent: the kit's SFT policy taught a calculator's call format, for agent tests that learn.

The kit's ``llama-sft`` never writes a tool call, so an agent run on it cannot learn tool use (nothing
to reinforce). :func:`kit_agent_folder` fine-tunes it, once, on conversations of the task of TRL's tools
example at kit scale (``tests/trl_scripts/agent_tools.py``): "What is A * B? Use the tools." or
"What is A + B? ...", single-digit A and B, the tools :func:`multiply` and :func:`async_add` offered in
the system turn of our tool template (:func:`~rlhf_trainers.agents.install_tool_chat_template`, short
instruction), in either order (the script's, and name order: an environment's methods, as in
``tests/trl_scripts/agent_environment.py``). Half of the training conversations call the right tool with the question's numbers and
then state the tool's result ("The answer is 42."); the other half answer at once with a guess. So the
agent calls the tool in about half of its episodes, and a reward for the right answer (which a guess
rarely gets) has something to raise: the share of episodes that call the tool.

:func:`multiply` and :func:`async_add` are the script's functions written again (a user's script cannot
be imported without running it); ``tests/test_agent_learning.py`` checks that their schemas are equal.

The folder (model, tokenizer with the tool template, ``max_position_embeddings`` 1024: the tools' schemas
make ~620-token prompts, and RoPE has no position table) is cached beside the kit, keyed by
:data:`AGENT_KIT_VERSION` and the build's settings, and built in 2-4 minutes on 2 cores (2,000 steps).
Measured on the built agent (the first 20 updates of TRL's tools script, 16 episodes each, temperature
1): it calls a tool in 53 % of its episodes, and 41 % of its answers are right.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any

#: The instruction of the tool template's system turn (short: the kit's tokenizer spells most of it).
TOOLS_INSTRUCTION = "Tools:"
CALL_SHARE = 0.5
STEPS = 2000
BATCH = 16


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def async_add(a: int, b: int) -> int:
    """
    Asynchronously adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of the two integers.
    """
    return a + b


def kit_question(rng: random.Random, i: int) -> tuple[list[dict[str, str]], str]:
    """Row ``i``'s conversational prompt and its answer: a product for even ``i``, a sum for odd."""
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    op, value = ("*", a * b) if i % 2 == 0 else ("+", a + b)
    return [{"role": "user", "content": f"What is {a} {op} {b}? Use the tools."}], str(value)


def _conversation(rng: random.Random, i: int) -> list[dict[str, Any]]:
    prompt, answer = kit_question(rng, i)
    a, op, b = prompt[0]["content"].split("?")[0].split()[2:5]
    if rng.random() < CALL_SHARE:
        name = "multiply" if op == "*" else "async_add"
        call = {"type": "function", "function": {"name": name, "arguments": {"a": int(a), "b": int(b)}}}
        return [
            *prompt,
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": name, "content": answer},
            {"role": "assistant", "content": f"The answer is {answer}."},
        ]
    guess = str(rng.randint(4, 81))
    return [*prompt, {"role": "assistant", "content": f"The answer is {guess}."}]


#: Raised whenever :func:`_build` or the training data change (the folder's name holds it).
AGENT_KIT_VERSION = "2"  # 2: both orders of the tools (an environment's methods come in name order)


def _fingerprint() -> str:
    """The cache key of the built folder: the version and the settings of the build."""
    settings = [AGENT_KIT_VERSION, STEPS, BATCH, CALL_SHARE, TOOLS_INSTRUCTION]
    return hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:12]


def kit_agent_folder(kit: Any | None = None) -> Path:
    """The kit agent's folder (built on first use; see the module docstring)."""
    from filelock import FileLock

    from .kit import get_kit

    kit = kit or get_kit()
    folder = Path(kit.root) / f"agent-{_fingerprint()}"
    with FileLock(str(folder) + ".lock"):
        if not (folder / "agent.json").is_file():
            _build(kit, folder)
    return folder


def _encoded(
    tokenizer: Any, schemas: list[dict[str, Any]], conversation: list[dict[str, Any]]
) -> tuple[list[int], list[int]]:
    """A training conversation's ids and its assistant-token mask (the loss reads the policy's tokens)."""
    encoded = tokenizer.apply_chat_template(
        conversation, tools=schemas, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(encoded["input_ids"]), list(encoded["assistant_masks"])


def _build(kit: Any, folder: Path) -> None:
    """Fine-tune ``llama-sft`` on :func:`_conversation` s. Every conversation starts with the same system
    turn (the tools' schemas, ~550 of its ~620 tokens): it is run once per step, batch 1, and its keys and
    values are broadcast to the batch (a cache that keeps its gradient), so a step costs one prefix and
    ``BATCH`` short suffixes instead of ``BATCH`` whole conversations."""
    import torch
    from transformers import DynamicCache

    from ..agents import Toolbox, install_tool_chat_template
    from ..compat import cache_keyword

    tokenizer = install_tool_chat_template(kit.load_tokenizer(), tools_instruction=TOOLS_INSTRUCTION)
    # Both orders of the tools, in turn: the script's [multiply, async_add] and an environment's methods,
    # which TRL (and ours) offer in name order.
    orders = [Toolbox([multiply, async_add]).schemas, Toolbox([async_add, multiply]).schemas]
    model = kit.load_model("llama-sft")
    model.config.max_position_embeddings = 1024
    rng = random.Random(0)
    torch.manual_seed(0)
    prefixes = []  # per order, the shared prefix: the longest common start of two different conversations
    for schemas in orders:
        one, _ = _encoded(tokenizer, schemas, _conversation(random.Random(1), 0))
        two, _ = _encoded(tokenizer, schemas, _conversation(random.Random(2), 1))
        prefixes.append(one[: next(i for i, (x, y) in enumerate(zip(one, two, strict=False)) if x != y)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for step in range(STEPS):
        schemas, known = orders[step % 2], prefixes[step % 2]
        shared, prefix = len(known), torch.tensor([known])
        rows = [_encoded(tokenizer, schemas, _conversation(rng, step * BATCH + k)) for k in range(BATCH)]
        assert all(ids[:shared] == known for ids, _ in rows)
        width = max(len(ids) for ids, _ in rows) - shared
        ids = torch.full((BATCH, width), tokenizer.pad_token_id)
        labels = torch.full((BATCH, width), -100)
        attention = torch.zeros((BATCH, shared + width), dtype=torch.long)
        attention[:, :shared] = 1
        for k, (row, mask) in enumerate(rows):
            n = len(row) - shared
            ids[k, :n] = torch.tensor(row[shared:])
            attention[k, shared : shared + n] = 1
            labels[k, :n] = torch.where(torch.tensor(mask[shared:]).bool(), torch.tensor(row[shared:]), -100)
        lr = 3e-3 * min(1.0, (step + 1) / 20) * (1 - step / STEPS)
        for group in optimizer.param_groups:
            group["lr"] = lr
        out = model(input_ids=prefix, use_cache=True)
        cached = getattr(out, "cache", None) or out.past_key_values
        cache = DynamicCache()
        for layer, entry in enumerate(cached.layers):
            keys, values = entry.keys, entry.values
            cache.update(keys.expand(BATCH, -1, -1, -1), values.expand(BATCH, -1, -1, -1), layer)
        passed = {cache_keyword(model): cache}
        loss = model(input_ids=ids, attention_mask=attention, labels=labels, **passed).loss
        if step % 50 == 0 and os.environ.get("RLHF_TRAINERS_AGENT_KIT_VERBOSE"):
            print(f"kit agent step {step}: loss {loss.item():.3f}", flush=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    record = {
        "steps": STEPS,
        "final_loss": loss.item(),
        "call_share": CALL_SHARE,
        "shared_prefixes": [len(known) for known in prefixes],
    }
    (tmp / "agent.json").write_text(json.dumps(record))
    os.replace(tmp, folder)
