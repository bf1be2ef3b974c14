"""The offline kit: tiny models, tokenizers and a synthetic RLHF task, built locally in seconds.

Tests, examples, the demo and the benchmarks need causal LMs, reward models and a task whose
"human preference" is known, without touching the network. :func:`get_kit` builds all of that once
into a cache folder (10-15 s on 2 CPU cores) and afterwards returns it instantly.

The synthetic task
------------------
Sentences are generated from templates over a small vocabulary::

    the movie was | really bright but dull .
    i think the room is | warm and fine .
    <prompt>        | <completion>

A *prompt* is the opening of a sentence, up to where the first adjective goes ("the movie was"); a
*completion* is the rest, which always starts with a space (so ``prompt + completion`` is the full
sentence). Adjectives are drawn from three equally likely classes: :data:`POSITIVE_WORDS`,
:data:`NEGATIVE_WORDS` and :data:`NEUTRAL_WORDS`, so a model trained on the corpus writes mixed
sentiment and its mean true reward is near 0.

The hidden preference is :func:`true_reward`: the completion is lower-cased and split into words
(runs of letters and digits; whitespace and punctuation separate words and are not words), and::

    true_reward = (#positive words - #negative words) / max(#words, 1)      in [-1, 1]

"really bright but dull ." has 4 words, 1 positive and 1 negative: reward 0. "warm and fine ." scores
2/3. An RL-trained policy raises it by writing more, and denser, positive words; the ceiling 1.0 is
only reached by completions made of positive words alone (e.g. " good ."), which a KL penalty to the
starting policy should hold back.

Prompts are split by (template, noun) combination into disjoint "train" and "test" pools; all
datasets are generated from seeded local RNGs, so they are deterministic and cost nothing to make.

The assets
----------
=====================  ==========================================================================
``tokenizer``          byte-level BPE trained on the corpus; every vocabulary word (with and
                       without a leading space) is one token; ``<|endoftext|>`` is eos and bos,
                       ``<|pad|>`` is pad (never equal to eos); padding side "left"; chat template
``tokenizer-alt``      a second, different byte-level BPE (other corpus seed, smaller vocabulary,
                       pad and eos at other ids) for a reward model whose tokenizer differs
``llama``              random ``LlamaForCausalLM`` (hidden 64, 2 layers, 4 heads, 2 kv heads,
                       tied embeddings)
``gpt2``               random ``GPT2LMHeadModel`` (n_embd 64, 2 layers, 4 heads; keeps GPT-2's
                       default dropout 0.1, so code that must disable dropout can be tested)
``gpt_neox``           random ``GPTNeoXForCausalLM`` (Pythia-like: parallel residual, partial rotary)
``llama-sft``          ``llama`` trained on the corpus (plain text and chat-formatted): the starting
                       policy of the RL tests; it writes corpus-like sentences and then eos
``llama-seqcls``       ``LlamaForSequenceClassification`` (1 label): ``llama-sft``'s backbone, a new head
``gpt2-seqcls``        random ``GPT2ForSequenceClassification`` (1 label)
``gpt2-alt-seqcls``    the same with the alt tokenizer
=====================  ==========================================================================

Every model folder also holds its tokenizer, like a Hub repository, so
``AutoTokenizer.from_pretrained(kit.model_path(name))`` works. Sequence-classification heads are
untrained (scores near 0). Example::

    from rlhf_trainers.testing import get_kit, true_reward

    kit = get_kit()
    tokenizer = kit.load_tokenizer()
    policy = kit.load_model("llama-sft")
    prompts = list(kit.prompt_dataset("test", n=8)["prompt"])
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    out = policy.generate(**batch, max_new_tokens=12, do_sample=True, top_k=0)
    completions = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    print(true_reward(prompts, completions))

Caching: the default folder is ``$RLHF_TRAINERS_KIT_DIR`` if set, else
``~/.cache/rlhf_trainers/kit-<KIT_VERSION>``. A build happens in a temporary sibling folder that is
renamed into place when complete, under an ``fcntl`` lock so that concurrent processes (two test
sessions, two distributed ranks) build it once. A kit records a fingerprint of the source of
:mod:`.task` and :mod:`.assets` (what decides its content), so a kit built by different code is rebuilt
rather than silently reused.

The modules
-----------
:mod:`.task` the synthetic task and :func:`true_reward` (standard library only), :mod:`.assets` the
tokenizers and models and how they are built, :mod:`.kit` the kit folder (:func:`get_kit`,
:class:`OfflineKit`). Every public name is importable from ``rlhf_trainers.testing``.
"""

from .assets import (
    CAUSAL_MODEL_NAMES,
    CHAT_TEMPLATE,
    EOS_TOKEN,
    LORA_TARGET_MODULES,
    MODEL_NAMES,
    PAD_TOKEN,
    SEQ_CLS_MODEL_NAMES,
)
from .kit import KIT_VERSION, OfflineKit, default_kit_dir, get_kit
from .task import (
    CONJUNCTIONS,
    CONNECTIVES,
    INTENSIFIERS,
    NEGATIVE_WORDS,
    NEUTRAL_WORDS,
    NOUNS,
    POSITIVE_WORDS,
    VOCABULARY,
    _text_of,  # noqa: F401 - rlhf_trainers.demo.task reads completions' text with it
    true_reward,
)

__all__ = [
    "CAUSAL_MODEL_NAMES",
    "CHAT_TEMPLATE",
    "CONJUNCTIONS",
    "CONNECTIVES",
    "EOS_TOKEN",
    "INTENSIFIERS",
    "KIT_VERSION",
    "LORA_TARGET_MODULES",
    "MODEL_NAMES",
    "NEGATIVE_WORDS",
    "NEUTRAL_WORDS",
    "NOUNS",
    "PAD_TOKEN",
    "POSITIVE_WORDS",
    "SEQ_CLS_MODEL_NAMES",
    "VOCABULARY",
    "OfflineKit",
    "default_kit_dir",
    "get_kit",
    "true_reward",
]
