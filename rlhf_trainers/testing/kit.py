"""The kit folder: :func:`get_kit` builds it once (atomically, under a lock) and :class:`OfflineKit`
gives its paths, loaders and the synthetic task's datasets.

A kit records a fingerprint of the sources that decide its content (:mod:`.task` and :mod:`.assets`),
so a kit built by other code is rebuilt rather than silently reused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import assets, task
from .assets import _build
from .task import (
    _CORPUS_SEED,
    _CORPUS_SIZE,
    _DEFAULT_PREFERENCE_ROWS,
    _POOLS,
    _check_split,
    _generate_corpus,
    _generate_pairs,
)

try:  # POSIX only; elsewhere concurrent builders are not guarded.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

if TYPE_CHECKING:  # pragma: no cover
    import datasets
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

#: Bump when the assets change in a way users of an existing cache should not miss.
KIT_VERSION = "2"

_MANIFEST = "kit.json"


#: The modules whose source decides what a built kit holds (not this one: it only finds and loads kits).
_CONTENT_MODULES = (task, assets)


def _source_fingerprint() -> str:
    """Hash of the task's and the asset builder's source as imported: a kit built by other code is
    rebuilt, not reused."""
    digest = hashlib.sha256()
    try:
        for module in _CONTENT_MODULES:
            digest.update(Path(module.__file__).read_bytes())
    except OSError:  # pragma: no cover - e.g. running from a zip
        return "unknown"
    return digest.hexdigest()[:16]


_FINGERPRINT = _source_fingerprint()


def _read_manifest(root: Path) -> dict[str, Any] | None:
    """The manifest of a complete kit of this version at `root`, else None."""
    try:
        manifest = json.loads((root / _MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("kit_version") != KIT_VERSION or manifest.get("fingerprint") != _FINGERPRINT:
        return None
    return manifest


class OfflineKit:
    """A built kit folder: paths to its assets, loaders, and the synthetic task's datasets.

    Get one from :func:`get_kit`, which builds the folder when needed.
    """

    def __init__(self, root: str | os.PathLike[str], manifest: dict[str, Any] | None = None) -> None:
        self.root: Path = Path(root)
        """The kit folder."""
        if manifest is None:
            manifest = _read_manifest(self.root)
            if manifest is None:
                raise FileNotFoundError(
                    f"{self.root} is not a complete offline kit of version {KIT_VERSION}; use get_kit()."
                )
        self.manifest: dict[str, Any] = manifest
        """The build record: versions, vocabulary sizes, parameter counts, SFT losses, build timings."""

    def __repr__(self) -> str:
        return f"OfflineKit(root={str(self.root)!r}, version={KIT_VERSION!r})"

    @property
    def tokenizer_path(self) -> Path:
        """Folder of the main tokenizer (``AutoTokenizer.from_pretrained`` loads it)."""
        return self.root / "tokenizer"

    @property
    def alt_tokenizer_path(self) -> Path:
        """Folder of the alternative tokenizer (other vocabulary and ids; used by ``gpt2-alt-seqcls``)."""
        return self.root / "tokenizer-alt"

    def load_tokenizer(self, which: str = "main") -> PreTrainedTokenizerFast:
        """The main (``which="main"``) or the alternative (``"alt"``) tokenizer.

        Padding side "left", pad token ``<|pad|>`` (never eos), eos/bos ``<|endoftext|>``, chat template
        :data:`CHAT_TEMPLATE`. No special tokens are added when encoding.
        """
        from transformers import AutoTokenizer

        paths = {"main": self.tokenizer_path, "alt": self.alt_tokenizer_path}
        if which not in paths:
            raise ValueError(f"which={which!r}: must be 'main' or 'alt'.")
        return AutoTokenizer.from_pretrained(paths[which])

    @property
    def model_names(self) -> tuple[str, ...]:
        """Names of the models, for :meth:`model_path` and :meth:`load_model`."""
        return tuple(self.manifest["models"])

    def model_path(self, name: str) -> Path:
        """Folder of model `name`: config, safetensors weights, generation config and its tokenizer."""
        if name not in self.manifest["models"]:
            raise KeyError(f"no kit model {name!r}; the kit has {', '.join(self.model_names)}.")
        return self.root / "models" / name

    def load_model(self, name: str, **from_pretrained_kwargs: Any) -> PreTrainedModel:
        """Model `name` through its Auto class (causal LM or sequence classification), in eval mode.

        Keyword arguments go to ``from_pretrained`` (e.g. ``dtype=torch.bfloat16``).
        """
        import transformers

        path = self.model_path(name)
        auto_class = getattr(transformers, self.manifest["models"][name]["auto_class"])
        return auto_class.from_pretrained(path, **from_pretrained_kwargs)

    def corpus(self, n: int | None = None) -> list[str]:
        """The generated corpus (train-split prompts) the tokenizer and ``llama-sft`` were trained on.

        Args:
            n: how many sentences (the first `n`; any size, generated on demand); default: the
                corpus as used by the build (16384 sentences).
        """
        return _generate_corpus(_CORPUS_SEED, _CORPUS_SIZE if n is None else _check_n(n))

    def prompt_dataset(
        self, split: str = "train", n: int | None = None, chat: bool = False
    ) -> datasets.Dataset:
        """Prompts of `split` in a column "prompt".

        Args:
            split: "train" or "test": disjoint pools of (template, noun) combinations
                (288 and 96 distinct prompts), each in a fixed shuffled order.
            n: number of rows; default all distinct prompts of the split. Beyond the pool size the
                pool repeats.
            chat: if True each prompt is a list with one ``{"role": "user", "content": ...}`` message.
        """
        import datasets

        _check_split(split)
        pool = _POOLS[split]
        n = len(pool) if n is None else _check_n(n)
        prompts: list[Any] = [pool[i % len(pool)] for i in range(n)]
        if chat:
            prompts = [[{"role": "user", "content": p}] for p in prompts]
        return datasets.Dataset.from_dict({"prompt": prompts})

    def preference_dataset(
        self, split: str = "train", n: int | None = None, shape: str = "explicit"
    ) -> datasets.Dataset:
        """Preference pairs: for a prompt of `split`, two different generated completions, the one with
        the higher :func:`true_reward` is "chosen" (pairs that tie are resampled).

        Args:
            split: "train" or "test" (disjoint prompts, different seeds).
            n: number of rows; default 2048 for "train", 256 for "test". Deterministic, and the first
                `n` rows do not depend on `n`.
            shape: "explicit": columns prompt, chosen, rejected, the completions without the prompt
                (each starts with a space, so ``prompt + chosen`` is the full text);
                "implicit": columns chosen, rejected holding the full texts ``prompt + completion``;
                "chat": prompt (a user message list), chosen and rejected (assistant message lists
                whose content is the completion without its leading space).
        """
        import datasets

        _check_split(split)
        n = _DEFAULT_PREFERENCE_ROWS[split] if n is None else _check_n(n)
        rows = _generate_pairs(split, n)
        prompts = [r[0] for r in rows]
        chosen = [r[1] for r in rows]
        rejected = [r[2] for r in rows]
        if shape == "explicit":
            columns: dict[str, list[Any]] = {"prompt": prompts, "chosen": chosen, "rejected": rejected}
        elif shape == "implicit":
            columns = {
                "chosen": [p + c for p, c in zip(prompts, chosen, strict=True)],
                "rejected": [p + r for p, r in zip(prompts, rejected, strict=True)],
            }
        elif shape == "chat":
            columns = {
                "prompt": [[{"role": "user", "content": p}] for p in prompts],
                "chosen": [[{"role": "assistant", "content": c.strip()}] for c in chosen],
                "rejected": [[{"role": "assistant", "content": r.strip()}] for r in rejected],
            }
        else:
            raise ValueError(f"shape={shape!r}: must be 'explicit', 'implicit' or 'chat'.")
        return datasets.Dataset.from_dict(columns)


def _check_n(n: int) -> int:
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n={n!r}: must be a non-negative integer (or None for the default).")
    return n


_KITS: dict[str, OfflineKit] = {}


def default_kit_dir() -> Path:
    """``$RLHF_TRAINERS_KIT_DIR`` if set, else ``~/.cache/rlhf_trainers/kit-<KIT_VERSION>``."""
    env = os.environ.get("RLHF_TRAINERS_KIT_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "rlhf_trainers" / f"kit-{KIT_VERSION}"


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``fcntl`` lock on `lock_path` (blocks while another process holds it)."""
    with open(lock_path, "a+") as handle:
        if fcntl is not None:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def get_kit(root: str | os.PathLike[str] | None = None) -> OfflineKit:
    """The offline kit at `root` (default :func:`default_kit_dir`), built there first if needed.

    The first call in a process checks the folder's manifest; a missing, incomplete, older or
    differently-built kit is (re)built: 10-15 s on 2 CPU cores. Later calls for the same folder
    return the same object instantly.

    Building happens in a temporary sibling folder renamed into place at the end, under a lock file
    next to `root` (``<root>.lock``), so concurrent callers build once: the others wait and load.
    A folder that exists, is not empty and is not a kit is never overwritten (ValueError).
    """
    root = Path(root).expanduser() if root is not None else default_kit_dir()
    root = root.absolute()
    key = str(root)
    if key in _KITS:
        return _KITS[key]
    manifest = _read_manifest(root)
    if manifest is None:
        root.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive(root.parent / f"{root.name}.lock"):
            manifest = _read_manifest(root)  # another process may have built it while we waited
            if manifest is None:
                manifest = _build_in_place(root)
    kit = _KITS[key] = OfflineKit(root, manifest)
    return kit


def _build_in_place(root: Path) -> dict[str, Any]:
    """Build into a temporary sibling, then swap it in for `root` (caller holds the lock)."""
    if root.exists() and (not root.is_dir() or (any(root.iterdir()) and not (root / _MANIFEST).exists())):
        raise ValueError(
            f"{root} exists and is not an offline kit; pass an empty or new folder to get_kit(), "
            "or remove it."
        )
    tmp = root.parent / f".{root.name}.building-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        manifest = {"kit_version": KIT_VERSION, "fingerprint": _FINGERPRINT, **_build(tmp)}
        (tmp / _MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        if root.exists():  # an empty folder, or a kit of another version: moved aside, then removed
            old = root.parent / f".{root.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.rename(root, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest
