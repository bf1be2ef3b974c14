"""The training scripts behind ``rlhf-trainers reward|ppo|rloo|grpo`` and ``examples/*.py``.

Each module (:mod:`~rlhf_trainers.scripts.reward`, :mod:`~rlhf_trainers.scripts.ppo`,
:mod:`~rlhf_trainers.scripts.rloo`, :mod:`~rlhf_trainers.scripts.grpo`) has a ``main(argv=None, prog=None)`` that parses the command line
with ``transformers.HfArgumentParser`` over its script arguments and its trainer's config, trains, saves
the model and returns the metrics. The same ``main`` runs under ``accelerate launch`` (``accelerate launch
-m rlhf_trainers.cli ppo ...`` or ``accelerate launch examples/ppo.py ...``), on one process or many.

What they share (dataset loading from the Hub, a folder or a file, LoRA flags, the offline kit's
defaults, error messages for bad flags) is written once in :mod:`rlhf_trainers.scripts._common`.
Importing this package imports nothing heavy; the modules import ``transformers`` when they run.
"""
