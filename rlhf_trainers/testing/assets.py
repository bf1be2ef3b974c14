"""The offline kit's assets: the two tokenizers, the tiny models and the SFT that makes ``llama-sft``
(each asset is described in :mod:`rlhf_trainers.testing`). :func:`_build` writes them all into a new
folder and returns the build record; the kit folder, its cache and its lock are :mod:`.kit`'s.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .task import (
    _ALT_CORPUS_SEED,
    _CORPUS_SEED,
    _CORPUS_SIZE,
    _DATA_SEEDS,
    VOCABULARY,
    _generate_corpus,
    _split_sentence,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

# --------------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------------

#: End of text; also the bos token. Never the pad token.
EOS_TOKEN = "<|endoftext|>"
#: The padding token (distinct from eos).
PAD_TOKEN = "<|pad|>"
_ROLE_TOKENS = ("<|user|>", "<|assistant|>", "<|system|>")
# Special tokens get the first ids, in this order; the alt tokenizer uses another order so that
# every id differs between the two (pad is 1 in the main tokenizer and 0 in the alt one).
_MAIN_SPECIALS = (EOS_TOKEN, PAD_TOKEN, *_ROLE_TOKENS)
_ALT_SPECIALS = (PAD_TOKEN, EOS_TOKEN, "<|system|>", "<|assistant|>", "<|user|>")
_MAIN_VOCAB_SIZE = 1024
_ALT_VOCAB_SIZE = 448

#: Jinja chat template: each message is ``<|role|>`` + content + newline (any role string works);
#: with ``add_generation_prompt=True`` the text ends with ``<|assistant|>``.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set content = message['content'] -%}"
    "{%- else -%}{%- set content = message['content'] | map(attribute='text') | join('') -%}{%- endif -%}"
    "{{- '<|' ~ message['role'] ~ '|>' ~ content ~ '\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)


def _train_bpe(texts: list[str], vocab_size: int, specials: Sequence[str]) -> Any:
    """A byte-level BPE (``tokenizers.Tokenizer``) trained on `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Bare words (no leading space) follow special tokens in chat-formatted text: teach them too.
    bare = [" ".join([word] * 4) + "\n" + word for word in VOCABULARY]
    tokenizer.train_from_iterator(texts + bare * 8, trainer=trainer)
    return tokenizer


def _wrap_tokenizer(tokenizer: Any) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=list(_ROLE_TOKENS),
        padding_side="left",
        truncation_side="left",
        model_max_length=256,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------

#: Model names, by kind.
CAUSAL_MODEL_NAMES: tuple[str, ...] = (
    "llama",
    "gpt2",
    "gpt_neox",
    "llama-sft",
    "llama-hd32",
    "llama-hd32-sft",
)
SEQ_CLS_MODEL_NAMES: tuple[str, ...] = ("llama-seqcls", "gpt2-seqcls", "gpt2-alt-seqcls")
MODEL_NAMES: tuple[str, ...] = CAUSAL_MODEL_NAMES + SEQ_CLS_MODEL_NAMES

#: LoRA ``target_modules`` for each kit architecture (key: ``config.model_type``): the attention
#: projections (and, for Llama, the MLP).
LORA_TARGET_MODULES: dict[str, list[str]] = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
}

_MAX_POSITIONS = 256
_MODEL_SEEDS = {
    "llama": 11,
    "gpt2": 12,
    "gpt_neox": 13,
    "llama-seqcls": 14,
    "gpt2-seqcls": 15,
    "gpt2-alt-seqcls": 16,
    "llama-hd32": 18,
}

# SFT of llama -> llama-sft: next-token loss on the corpus, a quarter of it chat-formatted.
_SFT_SEED = 17
_SFT_STEPS = 300
_SFT_BATCH = 32
_SFT_LR = 3e-3
_SFT_WARMUP = 20
_SFT_CHAT_FRACTION = 0.25


def _base_config(kind: str, tokenizer: PreTrainedTokenizerFast) -> Any:
    from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig

    ids = {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }
    if kind in ("llama", "llama-hd32"):
        # llama-hd32: the same size with head size 32 instead of 16 (vLLM's CPU attention needs >= 32).
        heads, kv_heads = (4, 2) if kind == "llama" else (2, 1)
        return LlamaConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            intermediate_size=128,
            max_position_embeddings=_MAX_POSITIONS,
            tie_word_embeddings=True,
            **ids,
        )
    if kind == "gpt2":
        return GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=_MAX_POSITIONS, **ids)
    if kind == "gpt_neox":
        return GPTNeoXConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=256,
            max_position_embeddings=_MAX_POSITIONS,
            rotary_pct=0.25,
            use_parallel_residual=True,
            tie_word_embeddings=False,
            **ids,
        )
    raise ValueError(kind)  # pragma: no cover


def _init_model(auto_class: str, config: Any, seed: int) -> PreTrainedModel:
    """A randomly initialised model, seeded without touching the caller's global RNG."""
    import torch
    import transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, auto_class).from_config(config)
    _set_generation_ids(model, config)
    return model.eval()


def _set_generation_ids(model: PreTrainedModel, config: Any) -> None:
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.pad_token_id = config.pad_token_id
        generation_config.eos_token_id = config.eos_token_id
        generation_config.bos_token_id = config.bos_token_id


def _seq_cls_config(config: Any) -> Any:
    config = config.__class__.from_dict(config.to_dict())
    config.num_labels = 1  # pad_token_id is kept: the head reads the last non-pad token
    config.architectures = None
    return config


def _sft_examples(tokenizer: PreTrainedTokenizerFast, corpus: list[str]) -> list[list[int]]:
    """Token ids of the SFT examples: sentences + eos, a fraction rendered as a chat instead."""
    rng = random.Random(_SFT_SEED)
    texts = []
    for sentence in corpus:
        if rng.random() < _SFT_CHAT_FRACTION:
            prompt, completion = _split_sentence(sentence)
            messages = [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": completion.strip()},
            ]
            texts.append(tokenizer.apply_chat_template(messages, tokenize=False) + EOS_TOKEN)
        else:
            texts.append(sentence + EOS_TOKEN)
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def _train_sft(model: PreTrainedModel, examples: list[list[int]], pad_id: int) -> dict[str, float]:
    """Next-token training of `model` in place on `examples`; returns loss statistics."""
    import torch

    losses = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SFT_SEED)
        rng = random.Random(_SFT_SEED)
        optimizer = torch.optim.AdamW(model.parameters(), lr=_SFT_LR, weight_decay=0.0)

        def schedule(step: int) -> float:
            if step < _SFT_WARMUP:
                return (step + 1) / _SFT_WARMUP
            return max(0.05, 1.0 - (step - _SFT_WARMUP) / (_SFT_STEPS - _SFT_WARMUP))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        model.train()
        for _ in range(_SFT_STEPS):
            batch = rng.sample(examples, _SFT_BATCH)
            input_ids, attention_mask, labels = _right_pad(batch, pad_id)
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
        model.eval()
    tail = losses[-50:]
    return {"sft_first_loss": losses[0], "sft_final_loss": sum(tail) / len(tail)}


def _right_pad(batch: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    import torch

    width = max(len(ids) for ids in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, ids in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return input_ids, attention_mask, labels


@contextlib.contextmanager
def _timed(timings: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timings[name] = round(time.perf_counter() - start, 3)


def _eval_loss(model: PreTrainedModel, examples: list[list[int]], pad_id: int) -> float:
    import torch

    with torch.no_grad():
        input_ids, attention_mask, labels = _right_pad(examples, pad_id)
        return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss.item()


def _build(dest: Path) -> dict[str, Any]:
    """Build every asset into the (new, empty) folder `dest`; returns the manifest."""
    import torch
    import transformers

    start = time.perf_counter()
    timings: dict[str, float] = {}
    models: dict[str, dict[str, Any]] = {}
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # "Writing model shards" x 7 is noise here
    # One thread: these models are too small to gain from more (on a busy 2-core machine, two
    # threads were several times slower), and the weights then do not depend on the thread count.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        manifest = _build_assets(dest, timings, models)
    finally:
        torch.set_num_threads(threads)
        if bars:
            transformers.utils.logging.enable_progress_bar()
    manifest["build_seconds"] = round(time.perf_counter() - start, 3)
    return manifest


def _build_assets(dest: Path, timings: dict[str, float], models: dict[str, dict[str, Any]]) -> dict[str, Any]:
    import tokenizers
    import torch
    import transformers

    with _timed(timings, "tokenizer"):
        corpus = _generate_corpus(_CORPUS_SEED, _CORPUS_SIZE)
        tokenizer = _wrap_tokenizer(_train_bpe(corpus, _MAIN_VOCAB_SIZE, _MAIN_SPECIALS))
        tokenizer.save_pretrained(dest / "tokenizer")
    with _timed(timings, "tokenizer-alt"):
        alt_corpus = _generate_corpus(_ALT_CORPUS_SEED, _CORPUS_SIZE // 2)
        alt_tokenizer = _wrap_tokenizer(_train_bpe(alt_corpus, _ALT_VOCAB_SIZE, _ALT_SPECIALS))
        alt_tokenizer.save_pretrained(dest / "tokenizer-alt")

    def save(
        name: str, model: PreTrainedModel, model_tokenizer: PreTrainedTokenizerFast, auto_class: str
    ) -> None:
        folder = dest / "models" / name
        model.save_pretrained(folder)
        model_tokenizer.save_pretrained(folder)
        models[name] = {
            "auto_class": auto_class,
            "model_type": model.config.model_type,
            "tokenizer": "alt" if model_tokenizer is alt_tokenizer else "main",
            "parameters": sum(p.numel() for p in model.parameters()),
        }

    causal = "AutoModelForCausalLM"
    seq_cls = "AutoModelForSequenceClassification"
    kinds = ("llama", "gpt2", "gpt_neox", "llama-hd32")
    configs = {kind: _base_config(kind, tokenizer) for kind in kinds}
    for kind in kinds:
        with _timed(timings, kind):
            save(kind, _init_model(causal, configs[kind], _MODEL_SEEDS[kind]), tokenizer, causal)

    with _timed(timings, "llama-sft"):
        sft = transformers.AutoModelForCausalLM.from_pretrained(dest / "models" / "llama")
        examples = _sft_examples(tokenizer, corpus)
        stats = _train_sft(sft, examples, tokenizer.pad_token_id)
        held_out = _sft_examples(tokenizer, _generate_corpus(_DATA_SEEDS["test"], 256, split="test"))
        stats["sft_eval_loss"] = _eval_loss(sft, held_out, tokenizer.pad_token_id)
        save("llama-sft", sft, tokenizer, causal)
    with _timed(timings, "llama-hd32-sft"):
        sft_hd32 = transformers.AutoModelForCausalLM.from_pretrained(dest / "models" / "llama-hd32")
        stats_hd32 = _train_sft(sft_hd32, examples, tokenizer.pad_token_id)
        stats["hd32_sft_final_loss"] = stats_hd32["sft_final_loss"]
        stats["hd32_sft_eval_loss"] = _eval_loss(sft_hd32, held_out, tokenizer.pad_token_id)
        save("llama-hd32-sft", sft_hd32, tokenizer, causal)

    with _timed(timings, "llama-seqcls"):
        model = _init_model(seq_cls, _seq_cls_config(configs["llama"]), _MODEL_SEEDS["llama-seqcls"])
        model.model.load_state_dict(sft.model.state_dict())
        save("llama-seqcls", model, tokenizer, seq_cls)
    with _timed(timings, "gpt2-seqcls"):
        model = _init_model(seq_cls, _seq_cls_config(configs["gpt2"]), _MODEL_SEEDS["gpt2-seqcls"])
        save("gpt2-seqcls", model, tokenizer, seq_cls)
    with _timed(timings, "gpt2-alt-seqcls"):
        config = _seq_cls_config(_base_config("gpt2", alt_tokenizer))
        model = _init_model(seq_cls, config, _MODEL_SEEDS["gpt2-alt-seqcls"])
        save("gpt2-alt-seqcls", model, alt_tokenizer, seq_cls)

    return {
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "tokenizer_vocab_size": len(tokenizer),
        "alt_tokenizer_vocab_size": len(alt_tokenizer),
        "models": models,
        **{key: round(value, 4) for key, value in stats.items()},
        "sft_steps": _SFT_STEPS,
        "builder_pid": os.getpid(),
        "build_timings_s": timings,
    }
