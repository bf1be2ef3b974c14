"""The multi-turn rollout producer: episodes of assistant turns and tool results (docs/agents.md,
"Multi-turn rollouts").

:class:`MultiTurnProducer` implements the engine's
:class:`~rlhf_trainers.onpolicy.producer.RolloutProducer` like the single-turn producer, except for how
a response is made: the policy writes an assistant turn (up to a stop token: the end-of-sequence token or
the template's end of an assistant turn), the tool calls in it run (:class:`~rlhf_trainers.agents.Toolbox`),
the tool turn the chat template renders for their results (with the next assistant header) is appended
to the response, and the policy goes on, until a turn calls no tool, ``max_tool_calling_iterations``
tool turns were run, or ``response_length`` (``max_completion_length``) response tokens are spent (or,
with vLLM, the engine's context is full: :meth:`MultiTurnProducer.room`).

The response of a row is the whole episode after the prompt; ``SampledResponses.loss_mask`` marks the
tokens the policy wrote, so the inserted tool turns are in the sequence every forward pass reads but
carry no loss, no KL and no advantage (``Rollout.policy_mask``).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..onpolicy.producer import SingleTurnProducer
from ..onpolicy.rollout import SampledResponses, Scores
from .chat_template import check_tool_calling
from .parsing import parse_tool_calls
from .tools import Toolbox, ToolCall

#: End-of-turn tokens of common chat templates, added to the stop tokens when the tokenizer has the
#: token and its chat template writes it (ChatML's, Llama 3's, Gemma's).
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")


def turn_end_ids(tokenizer: Any, stop_ids: list[int]) -> list[int]:
    """The tokens that end an assistant turn: ``stop_ids`` (the end-of-sequence token) and the chat
    template's end-of-turn token, where it is one of the known ones (:data:`_TURN_END_TOKENS`)."""
    ids = list(stop_ids)
    template = getattr(tokenizer, "chat_template", None) or ""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    for token in _TURN_END_TOKENS:
        if token in vocab and isinstance(template, str) and token in template and vocab[token] not in ids:
            ids.append(vocab[token])
    return ids


@dataclass
class Episode:
    """One row's conversation after its prompt, as it is being generated."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    written: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    pending_calls: list[ToolCall] = field(default_factory=list)
    calls: int = 0
    failures: int = 0
    turns: int = 0
    hit_iteration_limit: bool = False
    toolbox: Toolbox | None = None
    """This episode's tools (an environment's, bound to it); None: the producer's."""

    def append(self, ids: list[int], written: bool, logprobs: list[float], entropy: list[float]) -> None:
        self.ids += ids
        self.written += [written] * len(ids)
        self.logprobs += logprobs
        self.entropy += entropy


class MultiTurnProducer(SingleTurnProducer):
    """Rollouts of tool-calling episodes (see the module docstring), with any generation backend (the
    builtin loop, ``transformers.generate``, colocated vLLM).

    Args:
        engine: the trainer (its sampler, tokenizer, reward sources and passes).
        toolbox: the tools the policy may call.
        max_iterations: most tool turns per episode (TRL's ``max_tool_calling_iterations``); None: no
            limit but ``response_length``.
    """

    def __init__(self, engine: Any, toolbox: Toolbox, max_iterations: int | None = None) -> None:
        super().__init__(engine)
        self.toolbox = toolbox
        self.max_iterations = max_iterations
        self.stop_ids = turn_end_ids(engine.processing_class, list(engine.sampler.stop_ids))
        if not self.stop_ids:
            raise ValueError(
                "tools need a token that ends an assistant turn, but the tokenizer has no EOS token and no "
                "stop_token_id is set; set stop_token='eos' with a tokenizer that has an eos_token."
            )

    # ---- sampling ----------------------------------------------------------------------------------

    def sample(
        self,
        batch: dict[str, Any],
        copies: int = 1,
        with_logprobs: bool = False,
        timings: dict[str, float] | None = None,
    ) -> SampledResponses:
        """``copies`` episodes per prompt of a collated ``batch`` (completion j of prompt i at row
        ``j * B + i``), each the tokens of its assistant turns and tool turns, with ``loss_mask`` True at
        the policy's tokens only and the conversations (assistant and tool messages) for the rewards."""
        timings = timings if timings is not None else defaultdict(float)
        device = self.engine.accelerator.device
        query = batch["input_ids"].to(device).repeat(copies, 1)
        query_mask = batch["attention_mask"].to(device).repeat(copies, 1).bool()
        prompts, columns = self._prompts_and_columns(batch)
        prompts = list(prompts) * copies
        columns = {name: list(values) * copies for name, values in columns.items()}
        query, query_mask, episodes = self.start_episodes(query, query_mask, prompts, columns)
        active = list(range(len(episodes)))
        iteration = 0
        while calls := self._generation_calls(len(active)):
            self._assistant_turns(
                episodes, active, query, query_mask, with_logprobs, timings, iteration == 0, calls
            )
            began = time.perf_counter()
            active = self._tool_turns(episodes, active, iteration)
            timings["timing/tools"] += time.perf_counter() - began
            iteration += 1
        return self._responses(episodes, query, query_mask.bool(), prompts, columns, with_logprobs)

    def start_episodes(
        self, query: torch.Tensor, query_mask: torch.Tensor, prompts: list[Any], columns: dict[str, list[Any]]
    ) -> tuple[torch.Tensor, torch.Tensor, list[Episode]]:
        """The episodes of the rows (one per row of ``query``, with the producer's tools) and the
        prompts they start from. An environment producer resets its environments here and may change
        the rows' prompts (and ``prompts`` in place)."""
        episodes = [Episode(prompt_ids=query[i][query_mask[i]].tolist()) for i in range(query.shape[0])]
        return query, query_mask, episodes

    def _assistant_turns(
        self,
        episodes: list[Episode],
        active: list[int],
        query: torch.Tensor,
        query_mask: torch.Tensor,
        with_logprobs: bool,
        timings: dict[str, float],
        first: bool,
        calls: int,
    ) -> None:
        """One assistant turn for each ``active`` episode, in chunks of :meth:`_chunk_rows` rows (one call
        for a backend that batches internally, vLLM); the first turn samples from the collated prompts
        exactly as the single-turn producer does. Each row may write what is left of its episode
        (:meth:`room`); the rows' limits go to the backend when they differ (vLLM stops each request there,
        so a row with a long context never asks the engine for more than it holds). ``calls``
        (:meth:`_generation_calls`) is how many generation calls every process makes in this round: past
        its own chunks a process makes :meth:`_idle_generation` calls."""
        engine = self.engine
        step = self._chunk_rows(len(active))
        pad = engine.processing_class.pad_token_id
        # an episode without room (a prompt that fills the engine's context) ends here, empty
        active = [r for r in active if self.room(episodes[r]) > 0]
        chunks = range(0, len(active), step) if active else range(0)
        for _ in range(calls - len(chunks)):
            began = time.perf_counter()
            self._idle_generation(query, query_mask)
            timings["timing/generate"] += time.perf_counter() - began
        for start in chunks:
            rows = active[start : start + step]
            if first:
                ids, mask = query[rows], query_mask[rows]
            else:
                ids, mask = _left_padded([episodes[r].prompt_ids + episodes[r].ids for r in rows], pad, query)
            rooms = [self.room(episodes[r]) for r in rows]
            budget = max(rooms)
            limits = {} if min(rooms) == budget else {"row_max_new_tokens": rooms}
            began = time.perf_counter()
            generated, extras = engine.sampler.generate(
                ids,
                mask,
                with_logprobs=with_logprobs,
                max_new_tokens=budget,
                stop_ids=self.stop_ids,
                **limits,
            )
            timings["timing/generate"] += time.perf_counter() - began
            stops = torch.isin(generated, torch.tensor(self.stop_ids, device=generated.device))
            for k, r in enumerate(rows):
                self._take_turn(episodes[r], generated[k], stops[k], extras, k, rooms[k])

    @property
    def context_length(self) -> int | None:
        """The most tokens a sequence (prompt + episode) may hold for the generation backend: the vLLM
        engine's ``max_model_len``; None for a backend without such a limit (the builtin loop)."""
        return getattr(self.engine.sampler.backend, "max_model_len", None)

    def room(self, episode: Episode, extra: int = 0) -> int:
        """The tokens the policy may still write in ``episode`` after ``extra`` more are appended: what is
        left of ``response_length``, and of the engine's context (:attr:`context_length`) after the
        prompt. The trainer refuses prompts + ``response_length`` longer than the engine's context when
        it is built, so the context bounds an episode only for prompts longer than those it measured."""
        room = self.engine.args.response_length - len(episode.ids) - extra
        context = self.context_length
        if context is not None:
            room = min(room, context - len(episode.prompt_ids) - len(episode.ids) - extra)
        return room

    def _chunk_rows(self, active: int) -> int:
        """Rows per generation call in a round with ``active`` episodes: ``local_rollout_forward_batch_size``,
        or all of them when the backend batches by itself."""
        if self.engine.sampler.backend.batches_internally:
            return max(active, 1)
        return self.engine.args.local_rollout_forward_batch_size

    def _generation_calls(self, active: int) -> int:
        """How many generation calls the next round of assistant turns makes on every process (0: every
        episode of every process has ended).

        Under several processes each generation call is a collective (:meth:`PolicySampler.generate
        <rlhf_trainers.onpolicy.sampling.PolicySampler.generate>` shares failures with an all-reduce; under
        ZeRO-3 the weights are gathered per call, or the forward passes run in step), while episodes take
        different numbers of turns on different processes. So the processes agree on one count per round
        (the most chunks any of them needs, one all-reduce) and run as many rounds as the longest episode
        of any process; one with fewer chunks makes idle calls (:meth:`_idle_generation`)."""
        calls = -(-active // self._chunk_rows(active))
        accelerator = self.engine.accelerator
        if accelerator.num_processes == 1:
            return calls
        counts = self.engine.collectives.gather(torch.tensor([calls], device=accelerator.device))
        return int(counts.max())

    def _idle_generation(self, query: torch.Tensor, query_mask: torch.Tensor) -> None:
        """A generation call whose tokens are thrown away (one row, one token), made by a process whose
        episodes have all ended (or need fewer calls this round) while another's go on, so that it joins
        the collectives of the others' calls."""
        self.engine.sampler.generate(query[:1], query_mask[:1], max_new_tokens=1, stop_ids=self.stop_ids)

    def _take_turn(
        self,
        episode: Episode,
        generated: torch.Tensor,
        stops: torch.Tensor,
        extras: dict[str, torch.Tensor] | None,
        k: int,
        room: int,
    ) -> None:
        """Append row ``k``'s sampled turn to ``episode`` (cut after its first stop token and at its
        ``room``) and read the tool calls of a turn that ended."""
        hits = stops.nonzero().flatten()
        end = int(hits[0]) + 1 if hits.numel() else generated.shape[0]
        ended = hits.numel() > 0 and end <= room
        n = min(end, room)
        ids = generated[:n].tolist()
        logprobs = extras["logprobs"][k, :n].float().tolist() if extras is not None else []
        entropy = (
            extras["entropy"][k, :n].float().tolist()
            if extras is not None and extras.get("entropy") is not None
            else []
        )
        context = episode.prompt_ids + episode.ids
        episode.append(ids, True, logprobs, entropy)
        episode.turns += 1
        tokenizer = self.engine.processing_class
        toolbox = episode.toolbox if episode.toolbox is not None else self.toolbox
        parsed = parse_tool_calls(ids, tokenizer, prefix=context, tools=toolbox.schemas)
        episode.messages.append(parsed.to_message())
        episode.pending_calls = list(parsed.tool_calls) if ended else []

    def _tool_turns(self, episodes: list[Episode], active: list[int], iteration: int) -> list[int]:
        """Run the pending calls of the ``active`` episodes and append their tool turns; returns the
        episodes that go on (a tool turn was appended with room for the policy after it)."""
        going_on = []
        for r in active:
            episode = episodes[r]
            if not episode.pending_calls:
                continue
            if self.max_iterations is not None and iteration >= self.max_iterations:
                episode.hit_iteration_limit = True
                continue
            toolbox = episode.toolbox if episode.toolbox is not None else self.toolbox
            results = toolbox.execute(episode.pending_calls)
            episode.calls += len(results)
            episode.failures += sum(not result.ok for result in results)
            messages = [result.to_message() for result in results]
            suffix = self.tool_turn_ids(messages)
            if self.room(episode, extra=len(suffix)) < 1:
                # no room for the results and a reply (in response_length or the engine's context): the
                # episode ends here, with the policy's turn (as TRL drops them)
                continue
            episode.messages += messages
            episode.append(suffix, False, [0.0] * len(suffix), [0.0] * len(suffix))
            going_on.append(r)
        return going_on

    def tool_turn_ids(self, tool_messages: list[dict[str, Any]]) -> list[int]:
        """The token ids the chat template renders after an assistant turn for ``tool_messages``: the
        tool turn(s) and the opening of the next assistant turn, cut where the assistant turn's stop
        token ends (the policy wrote everything up to it)."""
        tokenizer = self.engine.processing_class
        call = {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}
        head = [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
        ]
        prefix = _ids(tokenizer.apply_chat_template(head, tokenize=True, add_generation_prompt=False))
        full = _ids(
            tokenizer.apply_chat_template(head + tool_messages, tokenize=True, add_generation_prompt=True)
        )
        ends = [i for i, token in enumerate(prefix) if token in self.stop_ids]
        if ends:
            prefix = prefix[: ends[-1] + 1]
        if full[: len(prefix)] != prefix:
            raise ValueError(
                "The chat template is not prefix-preserving: rendering a tool turn after an assistant turn "
                "changed the assistant turn's tokens, so the tool result cannot be appended to a rollout. "
                "Use a prefix-preserving template (rlhf_trainers.agents.install_tool_chat_template)."
            )
        return full[len(prefix) :]

    def _responses(
        self,
        episodes: list[Episode],
        query: torch.Tensor,
        query_mask: torch.Tensor,
        prompts: list[Any],
        columns: dict[str, list[Any]],
        with_logprobs: bool,
    ) -> SampledResponses:
        """The episodes as right-padded (N, response_length) tensors, with the tool metrics."""
        device = query.device
        N, R = len(episodes), self.engine.args.response_length
        pad = self.engine.processing_class.pad_token_id
        response = torch.full((N, R), pad, dtype=torch.long, device=device)
        written = torch.zeros((N, R), dtype=torch.bool, device=device)
        lengths = torch.tensor([len(e.ids) for e in episodes], dtype=torch.long, device=device)
        logprobs = torch.zeros((N, R), dtype=torch.float32, device=device) if with_logprobs else None
        entropy = torch.zeros((N, R), dtype=torch.float32, device=device) if with_logprobs else None
        for i, episode in enumerate(episodes):
            n = len(episode.ids)
            response[i, :n] = torch.tensor(episode.ids, dtype=torch.long)
            written[i, :n] = torch.tensor(episode.written, dtype=torch.bool)
            if logprobs is not None and len(episode.logprobs) == n:
                logprobs[i, :n] = torch.tensor(episode.logprobs)
            if entropy is not None and len(episode.entropy) == n:
                entropy[i, :n] = torch.tensor(episode.entropy)
            else:
                entropy = None
        mask = torch.arange(R, device=device)[None, :] < lengths[:, None]
        return SampledResponses(
            query=query,
            query_mask=query_mask,
            response=response,
            response_mask=mask,
            lengths=lengths,
            prompts=prompts,
            columns=columns,
            generation_logprobs=logprobs,
            generation_entropy=entropy,
            loss_mask=written,
            conversations=[e.messages for e in episodes],
            extra_metrics=tool_metrics(episodes),
        )

    # ---- scoring -----------------------------------------------------------------------------------

    def score(self, samples: SampledResponses, timings: dict[str, float] | None = None) -> Scores:
        """The single-turn scoring of the whole episode (the reward functions get the conversation as
        ``completions`` for conversational prompts, the decoded episode otherwise); an episode "found
        its stop token" when its last token is one (its last turn ended, not cut by the length limit).
        The scores' ``completions`` (what the sample tables and ``log_completions`` show) are the
        conversations: assistant turns, tool calls and tool results."""
        scores = super().score(samples, timings)
        if samples.conversations is not None:
            scores.completions = [list(messages) for messages in samples.conversations]
        last = samples.response.gather(1, (samples.lengths - 1).clamp_min(0)[:, None])[:, 0]
        stops = torch.tensor(self.stop_ids, device=last.device)
        scores.found_stop = torch.isin(last, stops) & (samples.lengths > 0)
        return scores


def tool_setup(
    trainer: Any, tools: Sequence[Callable[..., Any]] | None, args: Any, processing_class: Any, model: Any
) -> tuple[Toolbox | None, Any]:
    """Check a trainer's ``tools=`` before anything loads but the tokenizer: returns the
    :class:`Toolbox` (None without tools) and the policy's tokenizer (loaded with ``model`` when
    ``processing_class`` is None), and sets the trainer's ``prompt_chat_template_kwargs`` so the prompts are
    rendered with the tools' schemas (the engine passes them to the prompts' chat template). Raises
    ``ValueError`` for what multi-turn rollouts do not support yet (dynamic sampling, ``truncate_after``)
    and for a chat template without tool support."""
    if tools is None or (isinstance(tools, (list, tuple)) and not tools):
        return None, processing_class
    toolbox = Toolbox(tools, timeout=args.tool_timeout)
    check_multi_turn_support(args, "tools= (multi-turn tool rollouts)")
    from ..onpolicy.setup import policy_tokenizer

    processing_class = policy_tokenizer(model, processing_class)
    check_tool_calling(processing_class, "The policy's tokenizer (processing_class)")
    trainer.prompt_chat_template_kwargs = {"tools": toolbox.schemas}
    return toolbox, processing_class


def check_multi_turn_support(args: Any, what: str) -> None:
    """Refuse the settings multi-turn rollouts do not support yet (dynamic sampling,
    ``truncate_after``), naming ``what`` asked for them."""
    unsupported = {
        "dynamic_sampling=True": args.dynamic_sampling,
        f"truncate_after={args.truncate_after}": args.truncate_after,
    }
    given = [name for name, value in unsupported.items() if value]
    if given:
        raise ValueError(
            f"{what} does not support {', '.join(given)} yet: every turn of a tool episode ends at its stop "
            "token. Leave dynamic_sampling and truncate_after at their defaults."
        )


def tool_metrics(episodes: list[Episode]) -> dict[str, list[float]]:
    """The tool metrics of the episodes, as values whose mean over all processes is logged: TRL's
    ``tools/call_frequency`` (calls per episode) and ``tools/failure_frequency`` (failed calls per call; 0
    without calls), and ours: ``tools/turns_per_episode`` (assistant turns),
    ``tools/iteration_limit_frequency`` (episodes stopped by ``max_tool_calling_iterations`` with calls
    pending) and ``tools/inserted_token_frequency`` (the response tokens that are tool turns)."""
    failed = [1.0] * sum(e.failures for e in episodes) + [0.0] * sum(e.calls - e.failures for e in episodes)
    tokens = [not w for e in episodes for w in e.written]
    return {
        "tools/call_frequency": [float(e.calls) for e in episodes],
        "tools/failure_frequency": failed or [0.0],
        "tools/turns_per_episode": [float(e.turns) for e in episodes],
        "tools/iteration_limit_frequency": [float(e.hit_iteration_limit) for e in episodes],
        "tools/inserted_token_frequency": [float(sum(tokens)) / max(len(tokens), 1)],
    }


def _ids(rendered: Any) -> list[int]:
    """The ids of a single ``apply_chat_template(..., tokenize=True)`` call, whatever it returned."""
    if isinstance(rendered, dict) or hasattr(rendered, "keys"):
        rendered = rendered["input_ids"]
    rendered = list(rendered)
    if rendered and isinstance(rendered[0], list):
        rendered = rendered[0]
    return [int(t) for t in rendered]


def _left_padded(rows: list[list[int]], pad: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` of ids left-padded with ``pad`` to the longest, and their bool mask, on ``like``'s device."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long, device=like.device)
    mask = torch.zeros((len(rows), width), dtype=torch.bool, device=like.device)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = True
    return ids, mask
