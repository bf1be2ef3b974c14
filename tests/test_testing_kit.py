"""The offline kit: build, cache, tokenizers, models, datasets and the hidden reward."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedTokenizerFast,
)

from rlhf_trainers.testing import (
    CAUSAL_MODEL_NAMES,
    EOS_TOKEN,
    KIT_VERSION,
    LORA_TARGET_MODULES,
    MODEL_NAMES,
    NEGATIVE_WORDS,
    PAD_TOKEN,
    POSITIVE_WORDS,
    SEQ_CLS_MODEL_NAMES,
    VOCABULARY,
    OfflineKit,
    default_kit_dir,
    get_kit,
    true_reward,
)
from rlhf_trainers.testing import kit as testing_kit

PROMPTS = ["the movie was", "i think the room is really", "we found"]


def _hashes(root: Path) -> dict[str, str]:
    """sha256 of every weight and tokenizer file of a kit, by relative path."""
    files = sorted([*root.rglob("*.safetensors"), *root.rglob("tokenizer.json")])
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def _words(texts):
    return [w for t in texts for w in t.replace(".", " ").replace(",", " ").split()]


# --------------------------------------------------------------------------------------------------
# Build and cache
# --------------------------------------------------------------------------------------------------

_CONCURRENT_BUILDER = """
import json, os, sys
from rlhf_trainers.testing import get_kit
kit = get_kit(sys.argv[1])
print(json.dumps({"pid": os.getpid(), "builder_pid": kit.manifest["builder_pid"]}))
"""


def test_fresh_builds_are_complete_identical_and_built_once(tmp_path):
    # Two processes race for one folder (only one may build: the other waits, then loads) while
    # this process builds another folder from scratch.
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", _CONCURRENT_BUILDER, str(tmp_path / "raced")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    fresh = get_kit(tmp_path / "fresh")
    assert fresh.manifest["builder_pid"] == os.getpid()

    # complete: every folder loads with the plain Auto classes
    assert set(fresh.model_names) == set(MODEL_NAMES)
    assert AutoTokenizer.from_pretrained(fresh.tokenizer_path).pad_token == PAD_TOKEN
    for name in MODEL_NAMES:
        auto = AutoModelForCausalLM if name in CAUSAL_MODEL_NAMES else AutoModelForSequenceClassification
        model = auto.from_pretrained(fresh.model_path(name))
        assert model.config.vocab_size == len(AutoTokenizer.from_pretrained(fresh.model_path(name)))
    assert not list(tmp_path.glob(".fresh.*")), "temporary build folders were left behind"

    reports = []
    for racer in racers:
        out, err = racer.communicate(timeout=240)
        assert racer.returncode == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    builders = {r["builder_pid"] for r in reports}
    assert len(builders) == 1 and builders <= {r["pid"] for r in reports}, reports

    # deterministic: identical weights and vocabularies across builds and processes
    hashes = _hashes(tmp_path / "fresh")
    assert len(hashes) == len(MODEL_NAMES) * 2 + 2
    assert hashes == _hashes(tmp_path / "raced")


_PRINT_FINGERPRINT = """
from rlhf_trainers.testing import kit
print(kit.__file__)
print(kit._FINGERPRINT)
"""


def test_fingerprint_follows_the_sources_of_the_kit_content(tmp_path):
    # Kits built by other code must be rebuilt: an edit to the task or to the asset builder changes the
    # fingerprint; an edit to the code that only finds and loads kits does not.
    package = Path(testing_kit.__file__).parents[1]

    def fingerprint_after_editing(module: str) -> str:
        root = tmp_path / module.removesuffix(".py")
        shutil.copytree(package, root / "rlhf_trainers", ignore=shutil.ignore_patterns("__pycache__"))
        with open(root / "rlhf_trainers" / "testing" / module, "a") as handle:
            handle.write("\n# edited\n")
        env = {**os.environ, "PYTHONPATH": str(root)}
        run = subprocess.run(
            [sys.executable, "-c", _PRINT_FINGERPRINT], cwd=root, env=env, capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr[-3000:]
        path, fingerprint = run.stdout.split()
        assert Path(path).is_relative_to(root)
        return fingerprint

    assert testing_kit._FINGERPRINT == testing_kit._source_fingerprint() != "unknown"
    assert fingerprint_after_editing("task.py") != testing_kit._FINGERPRINT
    assert fingerprint_after_editing("assets.py") != testing_kit._FINGERPRINT
    assert fingerprint_after_editing("kit.py") == testing_kit._FINGERPRINT


def test_second_get_kit_returns_the_loaded_kit_without_reading_the_folder(kit, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a second get_kit() read or built the folder again")

    monkeypatch.setattr(testing_kit, "_read_manifest", fail)
    monkeypatch.setattr(testing_kit, "_build_in_place", fail)
    assert get_kit() is kit
    assert get_kit(kit.root) is kit


def test_manifest(kit):
    manifest = json.loads((kit.root / "kit.json").read_text())
    assert manifest["kit_version"] == KIT_VERSION
    assert set(manifest["models"]) == set(MODEL_NAMES)
    assert set(manifest["build_timings_s"]) >= {"tokenizer", "tokenizer-alt", *MODEL_NAMES}
    assert manifest["sft_final_loss"] < manifest["sft_first_loss"] / 2
    for name, info in manifest["models"].items():
        assert 50_000 < info["parameters"] < 300_000, (name, info)


def test_default_dir_and_refusals(tmp_path, monkeypatch, kit):
    monkeypatch.setenv("RLHF_TRAINERS_KIT_DIR", str(tmp_path / "here"))
    assert default_kit_dir() == tmp_path / "here"
    monkeypatch.delenv("RLHF_TRAINERS_KIT_DIR")
    assert default_kit_dir().name == f"kit-{KIT_VERSION}"

    # a folder with other content is never overwritten
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not an offline kit"):
        get_kit(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"

    # a kit of another version is not taken as complete
    stale = tmp_path / "stale"
    shutil.copytree(kit.root, stale)
    OfflineKit(stale)  # a faithful copy is fine
    manifest = json.loads((stale / "kit.json").read_text())
    manifest["kit_version"] = "0"
    (stale / "kit.json").write_text(json.dumps(manifest))
    with pytest.raises(FileNotFoundError, match="not a complete offline kit"):
        OfflineKit(stale)

    with pytest.raises(KeyError, match="no kit model"):
        kit.model_path("gpt3")


# --------------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------------


def test_tokenizer_special_tokens_and_padding(kit, tmp_path):
    tok = kit.load_tokenizer()
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert tok.eos_token == EOS_TOKEN and tok.bos_token == EOS_TOKEN and tok.pad_token == PAD_TOKEN
    assert tok.pad_token_id != tok.eos_token_id
    assert tok.padding_side == "left"
    # encoding adds no special tokens; decoding round-trips
    ids = tok("the movie was good .")["input_ids"]
    assert EOS_TOKEN not in tok.convert_ids_to_tokens(ids)
    assert tok.decode(ids) == "the movie was good ."

    batch = tok(["good", "the movie was good ."], padding=True, return_tensors="pt")
    assert batch["input_ids"][0, 0] == tok.pad_token_id and batch["attention_mask"][0, 0] == 0
    assert batch["input_ids"][0, -1] != tok.pad_token_id

    # left padding survives a save/reload round trip and is in every model folder
    tok.save_pretrained(tmp_path / "tok")
    assert AutoTokenizer.from_pretrained(tmp_path / "tok").padding_side == "left"
    for name in MODEL_NAMES:
        folder_tok = AutoTokenizer.from_pretrained(kit.model_path(name))
        assert folder_tok.padding_side == "left"
        assert folder_tok.pad_token_id != folder_tok.eos_token_id


def test_every_vocabulary_word_is_one_token(kit):
    tok = kit.load_tokenizer()
    for word in VOCABULARY:
        spaced = tok(" " + word)["input_ids"]
        assert len(spaced) == 1 and tok.convert_ids_to_tokens(spaced) == ["Ġ" + word], word
        assert len(tok(word)["input_ids"]) == 1, word  # as the first word of a chat message
    assert 500 <= len(tok) <= 1024


def test_chat_template(kit):
    tok = kit.load_tokenizer()
    messages = [
        {"role": "system", "content": "be kind"},
        {"role": "user", "content": "the movie was"},
        {"role": "assistant", "content": "really good ."},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == "<|system|>be kind\n<|user|>the movie was\n<|assistant|>really good .\n"
    prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|system|>be kind\n<|user|>the movie was\n<|assistant|>"
    # role tokens are single special tokens
    ids = tok(prompt)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|system|>") and ids[-1] == tok.convert_tokens_to_ids(
        "<|assistant|>"
    )
    # any role renders
    odd = tok.apply_chat_template(
        [{"role": "tool", "content": "42"}], tokenize=False, add_generation_prompt=True
    )
    assert odd == "<|tool|>42\n<|assistant|>"


def test_alt_tokenizer_differs(kit):
    main, alt = kit.load_tokenizer(), kit.load_tokenizer("alt")
    assert alt.padding_side == "left" and alt.pad_token_id != alt.eos_token_id
    assert alt.get_vocab() != main.get_vocab() and len(alt) < len(main)
    assert alt.pad_token_id != main.pad_token_id and alt.eos_token_id != main.eos_token_id
    text = "i think the movie was really lovely and warm ."
    assert alt(text)["input_ids"] != main(text)["input_ids"]
    assert alt.decode(alt(text)["input_ids"]) == text
    folder = AutoTokenizer.from_pretrained(kit.model_path("gpt2-alt-seqcls"))
    assert folder.get_vocab() == alt.get_vocab()
    assert AutoTokenizer.from_pretrained(kit.model_path("gpt2-seqcls")).get_vocab() == main.get_vocab()


# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CAUSAL_MODEL_NAMES)
def test_causal_generation_left_padded(kit, name):
    tok = kit.load_tokenizer()
    model = kit.load_model(name)
    assert not model.training
    assert model.generation_config.pad_token_id == tok.pad_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    width = batch["input_ids"].shape[1]
    assert (batch["attention_mask"] == 0).any(), "the batch should be left padded"
    torch.manual_seed(0)
    for kwargs in ({"do_sample": True, "top_k": 0, "top_p": 1.0}, {"do_sample": False}):
        out = model.generate(**batch, max_new_tokens=6, **kwargs)
        assert torch.equal(out[:, :width], batch["input_ids"])  # prompts preserved
        new = out[:, width:]
        assert new.shape[1] >= 1
        assert (new[:, 0] != tok.pad_token_id).all()  # every row produced a token
    if name == "llama-sft":  # greedy on a padded row equals greedy on the row alone
        for row, prompt in enumerate(PROMPTS):
            alone = tok(prompt, return_tensors="pt")
            ref = model.generate(**alone, max_new_tokens=6, do_sample=False)
            n = ref.shape[1] - alone["input_ids"].shape[1]
            assert torch.equal(out[row, width : width + n], ref[0, -n:])


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_reload_gives_identical_logits(kit, name):
    tok = AutoTokenizer.from_pretrained(kit.model_path(name))
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        first = kit.load_model(name)(**batch).logits
        second = kit.load_model(name)(**batch).logits
    assert torch.isfinite(first).all()
    assert torch.equal(first, second)


@pytest.mark.parametrize("name", CAUSAL_MODEL_NAMES)
def test_lora_adapter_trains_only_the_adapter(kit, name):
    from peft import LoraConfig, get_peft_model

    tok = kit.load_tokenizer()
    model = kit.load_model(name)
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        base_logits = model(**batch).logits
    config = LoraConfig(
        task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=LORA_TARGET_MODULES[model.config.model_type]
    )
    peft_model = get_peft_model(model, config)
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():  # LoRA's B starts at zero: the adapted model starts as the base model
        torch.testing.assert_close(peft_model(**batch).logits, base_logits)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    peft_model(**batch, labels=labels).loss.backward()
    for n, p in peft_model.named_parameters():
        if n in trainable:
            assert p.grad is not None and torch.isfinite(p.grad).all(), n
        else:
            assert p.grad is None, n
    assert any(p.grad.abs().sum() > 0 for n, p in peft_model.named_parameters() if n in trainable)


@pytest.mark.parametrize("name", SEQ_CLS_MODEL_NAMES)
def test_seq_cls_score_is_read_at_the_last_real_token(kit, name):
    tok = AutoTokenizer.from_pretrained(kit.model_path(name))
    model = kit.load_model(name)
    assert model.config.num_labels == 1 and model.config.pad_token_id == tok.pad_token_id
    texts = ["the movie was good .", "i think the room is very dull but fine and warm ."]
    with torch.no_grad():
        alone = torch.cat([model(**tok(t, return_tensors="pt")).logits for t in texts])
        tok.padding_side = "right"
        right = model(**tok(texts, return_tensors="pt", padding=True)).logits
        tok.padding_side = "left"
        left_batch = tok(texts, return_tensors="pt", padding=True)
        assert left_batch["attention_mask"][0, 0] == 0
        left = model(**left_batch).logits
        positions = (left_batch["attention_mask"].cumsum(1) - 1).clamp(min=0)
        left_positioned = model(**left_batch, position_ids=positions).logits
    assert alone.shape == right.shape == left.shape == (2, 1)
    # The head reads the last non-pad token whatever the padding side: right padding, and left
    # padding with position ids that skip the padding, give the unpadded scores.
    torch.testing.assert_close(right, alone)
    torch.testing.assert_close(left_positioned, alone, rtol=1e-5, atol=1e-5)
    # Without position ids, left padding shifts the positions of the real tokens: harmless for
    # Llama (rotary embeddings see relative positions only), not for GPT-2 (absolute positions).
    if model.config.model_type == "llama":
        torch.testing.assert_close(left, alone, rtol=1e-5, atol=1e-5)
    else:
        assert not torch.allclose(left[0], alone[0], atol=1e-3)
        torch.testing.assert_close(left[1], alone[1])  # the longest row has no padding


def test_llama_seqcls_shares_the_sft_backbone(kit):
    sft = kit.load_model("llama-sft")
    rm = kit.load_model("llama-seqcls")
    sft_state = sft.model.state_dict()
    for key, value in rm.model.state_dict().items():
        assert torch.equal(value, sft_state[key]), key
    assert rm.score.weight.shape == (1, 64)


def test_gpt2_keeps_dropout_for_tests_that_disable_it(kit):
    assert kit.load_model("gpt2").config.resid_pdrop > 0
    assert kit.load_model("llama").config.attention_dropout == 0


# --------------------------------------------------------------------------------------------------
# The task
# --------------------------------------------------------------------------------------------------


def test_true_reward_by_hand():
    prompts = ["p"] * 7
    completions = [
        " good and nice .",  # 3 words, 2 positive
        " really bright but dull .",  # 4 words, 1 - 1
        " bad .",
        "",
        "GOOD, great!awful",  # case and punctuation: good, great, awful
        " sweet .<|endoftext|><|pad|>",  # special tokens are not words
        " the movie was lovely",
    ]
    expected = [2 / 3, 0.0, -1.0, 0.0, 1 / 3, 1.0, 0.25]
    assert true_reward(prompts, completions) == pytest.approx(expected)
    # messages, keyword call with extra columns (the reward-function signature)
    chat = true_reward(
        prompts=[[{"role": "user", "content": "the movie was"}]],
        completions=[[{"role": "assistant", "content": "warm and cold and sad"}]],
        ground_truth=["ignored"],
        trainer_state=None,
    )
    assert chat == pytest.approx([-1 / 5])
    assert true_reward(None, [" happy"]) == [1.0]
    with pytest.raises(ValueError, match="pair up"):
        true_reward(["a", "b"], [" good"])
    assert set(POSITIVE_WORDS).isdisjoint(NEGATIVE_WORDS)


def test_prompt_datasets(kit):
    train, test = kit.prompt_dataset("train"), kit.prompt_dataset("test")
    assert train.column_names == ["prompt"] and len(train) == 288 and len(test) == 96
    assert len(set(train["prompt"])) == len(train)
    assert set(train["prompt"]).isdisjoint(test["prompt"])
    assert kit.prompt_dataset("test", n=4)["prompt"] == test["prompt"][:4]
    assert kit.prompt_dataset("test", n=100)["prompt"][96:] == test["prompt"][:4]  # the pool repeats
    chat = kit.prompt_dataset("test", n=3, chat=True)
    assert chat["prompt"] == [[{"role": "user", "content": p}] for p in test["prompt"][:3]]
    with pytest.raises(ValueError, match="split"):
        kit.prompt_dataset("validation")


def test_preference_datasets(kit):
    explicit = kit.preference_dataset("train")
    assert explicit.column_names == ["prompt", "chosen", "rejected"] and len(explicit) == 2048
    scores_c = true_reward(explicit["prompt"], explicit["chosen"])
    scores_r = true_reward(explicit["prompt"], explicit["rejected"])
    assert all(c > r for c, r in zip(scores_c, scores_r, strict=True))
    assert all(
        c.startswith(" ") and r.startswith(" ")
        for c, r in zip(explicit["chosen"], explicit["rejected"], strict=True)
    )
    # the completions are drawn from the generator: all words are vocabulary words
    assert set(_words(explicit["chosen"][:200] + explicit["rejected"][:200])) <= set(VOCABULARY)

    implicit = kit.preference_dataset("train", n=64, shape="implicit")
    assert implicit.column_names == ["chosen", "rejected"]
    assert implicit["chosen"] == [
        p + c for p, c in zip(explicit["prompt"][:64], explicit["chosen"][:64], strict=True)
    ]
    chat = kit.preference_dataset("train", n=64, shape="chat")
    assert chat.column_names == ["prompt", "chosen", "rejected"]
    assert chat[0]["prompt"] == [{"role": "user", "content": explicit[0]["prompt"]}]
    assert chat[0]["chosen"] == [{"role": "assistant", "content": explicit[0]["chosen"].strip()}]
    assert chat[0]["rejected"] == [{"role": "assistant", "content": explicit[0]["rejected"].strip()}]

    test = kit.preference_dataset("test")
    assert len(test) == 256
    assert set(test["prompt"]).isdisjoint(explicit["prompt"])
    assert kit.preference_dataset("test", n=10).to_list() == test.to_list()[:10]  # deterministic
    with pytest.raises(ValueError, match="shape"):
        kit.preference_dataset(shape="pairs")


def test_edge_case_pairs_follow_the_hidden_rule():
    from rlhf_trainers.testing.kit_reward import edge_case_pairs

    pairs = edge_case_pairs("train", 64)
    assert pairs.column_names == ["prompt", "chosen", "rejected"] and len(pairs) == 64
    chosen = true_reward(pairs["prompt"], pairs["chosen"])
    rejected = true_reward(pairs["prompt"], pairs["rejected"])
    assert all(c > r for c, r in zip(chosen, rejected, strict=True))
    # in turn: the empty completion, a cut one (no final " ."), two sentences, a sentence and stray " .",
    # a sentence and the same diluted by one or two words that count 0
    assert all("" in pair for pair in zip(pairs["chosen"][0::5], pairs["rejected"][0::5], strict=True))
    for cut in zip(pairs["chosen"][1::5], pairs["rejected"][1::5], strict=True):
        assert any(c.strip() and not c.endswith(".") for c in cut)
    for run_on in zip(pairs["chosen"][2::5], pairs["rejected"][2::5], strict=True):
        assert any(c.count(" .") == 2 and c.endswith(" .") for c in run_on)
    for stray in zip(pairs["chosen"][3::5], pairs["rejected"][3::5], strict=True):
        assert any(c.endswith(" . .") for c in stray)
    for diluted in zip(pairs["chosen"][4::5], pairs["rejected"][4::5], strict=True):
        short, long = sorted(diluted, key=len)
        assert long.count(" ") - short.count(" ") in (1, 2) and set(short.split()) <= set(long.split())
    assert edge_case_pairs("train", 10).to_list() == pairs.to_list()[:10]  # deterministic, prefix-stable
    assert set(edge_case_pairs("test", 32)["prompt"]).isdisjoint(pairs["prompt"])
    with pytest.raises(ValueError, match="split"):
        edge_case_pairs("validation", 4)


def test_kit_reward_model_ranks_the_empty_completion_by_the_hidden_rule(kit, reward_model_dir):
    """The empty completion (true reward 0) scores below a positive completion and above a negative one on
    every held-out prompt: a reward model that ranked it near the top let GRPO learn to stop at once."""
    from rlhf_trainers.models import load_reward_model
    from rlhf_trainers.rewards import score_texts

    model, _ = load_reward_model(reward_model_dir)
    tokenizer = kit.load_tokenizer()
    prompts = kit.prompt_dataset("test")["prompt"]

    def scores(completion):
        texts = [p + completion for p in prompts]
        return score_texts(model, tokenizer, texts, add_eos=True, normalize=False)

    empty, positive, negative = scores(""), scores(" good and nice ."), scores(" bad and cold .")
    print(
        f"margins: positive - empty >= {float((positive - empty).min()):.2f}, empty - negative >= "
        f"{float((empty - negative).min()):.2f}"
    )
    assert float((positive - empty).min()) > 1.0 and float((empty - negative).min()) > 1.0


def test_kit_reward_model_prefers_the_denser_sentence_at_the_eos(kit, reward_model_dir):
    """Read at the EOS (how a trainer scoring token ids reads it), " great ." (true reward 1) scores above
    " great and great ." (2/3) on every held-out prompt, and " nice ." above " really nice ." (1/2): a
    reward model that scored them alike let GRPO policies settle on the diluted form (issue #23)."""
    from rlhf_trainers.models import load_reward_model
    from rlhf_trainers.rewards import score_texts

    model, _ = load_reward_model(reward_model_dir)
    tokenizer = kit.load_tokenizer()
    prompts = kit.prompt_dataset("test")["prompt"]

    def scores(completion):
        return score_texts(model, tokenizer, [p + completion for p in prompts], add_eos=True, normalize=False)

    for dense, diluted in ((" great .", " great and great ."), (" nice .", " really nice .")):
        margin = scores(dense) - scores(diluted)
        print(f"{dense!r} - {diluted!r}: min {float(margin.min()):.2f}, mean {float(margin.mean()):.2f}")
        assert float(margin.min()) > 0


def test_corpus(kit):
    corpus = kit.corpus()
    assert len(corpus) == 16384 and kit.corpus(5) == corpus[:5]
    assert set(_words(corpus[:500])) == set(VOCABULARY)
    train_prompts = kit.prompt_dataset("train")["prompt"]
    assert all(any(s.startswith(p + " ") for p in train_prompts) for s in corpus[:100])
    # the sentiment words are balanced: the corpus' completions average a true reward near 0
    rewards = true_reward(None, corpus)
    assert abs(sum(rewards) / len(rewards)) < 0.02


def _sample(kit, prompts, chat=False, seed=0):
    tok = kit.load_tokenizer()
    model = kit.load_model("llama-sft")
    texts = (
        [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
        if chat
        else prompts
    )
    batch = tok(texts, return_tensors="pt", padding=True)
    torch.manual_seed(seed)
    out = model.generate(**batch, max_new_tokens=20, do_sample=True, top_k=0, top_p=1.0)
    new = out[:, batch["input_ids"].shape[1] :]
    return tok.batch_decode(new, skip_special_tokens=True), (new == tok.eos_token_id).any(1)


def test_sft_model_learned_the_corpus(kit):
    prompts = list(kit.prompt_dataset("test")["prompt"])  # held-out prompts
    completions, ended = _sample(kit, prompts)
    rewards = true_reward(prompts, completions)
    mean = sum(rewards) / len(rewards)
    assert abs(mean) < 0.5, mean
    assert len(set(rewards)) > 5  # mixed sentiment, not one answer
    words = _words(completions)
    assert sum(w in VOCABULARY for w in words) / len(words) > 0.9
    assert ended.float().mean() > 0.8  # it stops with eos
    assert sum(c.startswith(" ") and c.rstrip().endswith(".") for c in completions) / len(completions) > 0.8

    # it also answers chat-formatted prompts
    chat_prompts = list(kit.prompt_dataset("test", n=32, chat=True)["prompt"])
    chat_completions, chat_ended = _sample(kit, chat_prompts, chat=True)
    chat_words = _words(chat_completions)
    assert sum(w in VOCABULARY for w in chat_words) / len(chat_words) > 0.9
    assert chat_ended.float().mean() > 0.8
