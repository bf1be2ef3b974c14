"""Checking a model given as a path or Hub id before anything is loaded.

Every place that loads a model or tokenizer from a string (the trainers' ``model=``, ``ref_model=``,
``reward_model=``, ``value_model=``, GRPO's ``reward_funcs=``, the reward trainer's ``model=`` and
``normalization_policy=``, and the command line's ``--*_name_or_path`` flags) calls
:func:`check_model_path` first, so that a folder that does not exist, or a Hub id that cannot be
fetched, fails at once with one message naming what was given and what to pass, instead of
transformers' traceback about repository ids or connections.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: Files whose presence makes a folder (or a Hub repository) a loadable model.
MODEL_FILES = ("config.json", "adapter_config.json")

#: Seconds to wait for the Hub when a Hub id is neither a folder nor in the local cache.
HUB_TIMEOUT_S = 10.0

_HUB_IDS_SEEN: set[tuple[str, str | None]] = set()

_WHAT_TO_PASS = (
    "Pass a folder saved with save_pretrained (one holding config.json, e.g. written by "
    "`rlhf-trainers reward` or trainer.save_model) or a Hub model id such as 'Qwen/Qwen2.5-0.5B-Instruct'."
)


class ModelNotFoundError(ValueError, FileNotFoundError):
    """A model path or Hub id that names nothing loadable. A ``ValueError`` (bad input, as the
    command line reports it) and a ``FileNotFoundError`` (an ``OSError``, as transformers raises
    for the same case)."""


def looks_like_local_path(value: str) -> bool:
    """Whether `value` can only mean a local path: it starts with ``/``, ``./``, ``../`` or ``~``, holds a
    backslash, or has more than one ``/`` (a Hub id has at most one: ``owner/name``)."""
    return (
        value.startswith(("/", "./", "../", "~", ".\\", "..\\"))
        or value in {".", ".."}
        or "\\" in value
        or value.count("/") > 1
        or os.path.isabs(value)
    )


def is_plausible_hub_id(value: str) -> bool:
    """Whether `value` is spelled like a Hub model id (``name`` or ``owner/name``)."""
    if looks_like_local_path(value) or not value:
        return False
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def _hub_offline(kwargs: Mapping[str, Any]) -> str | None:
    """Why the Hub is not asked (an environment variable or ``local_files_only``), or None."""
    if kwargs.get("local_files_only"):
        return "local_files_only=True was given"
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}:
            return f"{name}={os.environ[name]} is set"
    return None


def _in_hub_cache(repo_id: str, kwargs: Mapping[str, Any]) -> bool:
    from huggingface_hub import try_to_load_from_cache

    names = list(MODEL_FILES)
    if kwargs.get("gguf_file"):
        names.append(str(kwargs["gguf_file"]))
    for name in names:
        found = try_to_load_from_cache(
            repo_id, name, cache_dir=kwargs.get("cache_dir"), revision=kwargs.get("revision")
        )
        if isinstance(found, str):
            return True
    return False


def _hub_problem(repo_id: str, kwargs: Mapping[str, Any]) -> str | None:
    """What is wrong with asking the Hub for `repo_id` (unreachable, no such repository), or None."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    try:
        HfApi().model_info(repo_id, revision=kwargs.get("revision"), timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        return None  # transformers says how to request access
    except RepositoryNotFoundError:
        return "there is no such model on the Hub (or it is private: log in with `hf auth login` or set HF_TOKEN)"
    except HfHubHTTPError:
        return None  # the Hub answered: let from_pretrained report the details
    except Exception as err:
        return f"the Hub cannot be reached ({type(err).__name__}: {err})"
    return None


def _folder_problem(path: Path, kwargs: Mapping[str, Any]) -> str | None:
    """What keeps the existing folder `path` from loading as a model, or None."""
    if kwargs.get("gguf_file") or any((path / name).is_file() for name in MODEL_FILES):
        return None
    inside = sorted(
        child.name for child in path.iterdir() if child.is_dir() and (child / "config.json").is_file()
    )
    hint = f" Its subfolder(s) {', '.join(inside[-3:])} hold a model: pass one of them." if inside else ""
    return f"the folder {path.resolve()} holds no config.json, so it is not a saved model.{hint}"


def _missing_folder_message(path: Path) -> str:
    full = path.absolute()
    message = f"the folder {full} does not exist."
    parent = full.parent
    if parent.is_dir():
        siblings = [child.name for child in parent.iterdir() if child.is_dir()]
        close = difflib.get_close_matches(path.name, siblings, n=3, cutoff=0.6)
        if close:
            message += f" Did you mean {' or '.join(str(parent / name) for name in close)}?"
    return message


def check_model_path(value: Any, what: str, *, model_kwargs: Mapping[str, Any] | None = None) -> None:
    """Raise :class:`ModelNotFoundError` unless `value` is a model instance, an existing model folder, a
    Hub id in the local Hub cache, or a Hub id the Hub can serve.

    Args:
        value: what was given for the model: a model instance (accepted as is), a path or a Hub id.
        what: how the error names it, e.g. ``"model"``, ``"reward_funcs[1]"`` or
            ``"--reward_model_name_or_path"``.
        model_kwargs: the ``from_pretrained`` keyword arguments the model will be loaded with
            (``cache_dir``, ``revision``, ``local_files_only`` and ``gguf_file`` are read).

    A Hub id that is not cached is looked up on the Hub once per process (at most
    :data:`HUB_TIMEOUT_S` seconds), unless ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set, in
    which case it is refused at once.
    """
    if not isinstance(value, (str, os.PathLike)):
        return
    kwargs = dict(model_kwargs or {})
    text = os.fspath(value)
    path = Path(text)
    given = f"{what} {text}" if what.startswith("--") else f"{what}={text!r}"
    if text.startswith("~"):  # from_pretrained reads the path as written
        home = path.expanduser()
        raise ModelNotFoundError(
            f"{given}: '~' is not expanded when models are loaded; pass the full path, {home}"
            f"{'' if home.is_dir() else ' (which does not exist either)'}."
        )
    if path.is_dir():
        problem = _folder_problem(path, kwargs)
        if problem:
            raise ModelNotFoundError(f"{given}: {problem} {_WHAT_TO_PASS}")
        return
    if path.exists():
        raise ModelNotFoundError(
            f"{given}: {path.resolve()} is a file; a model is a folder. Pass the folder that holds it "
            f"({path.resolve().parent}) if it has a config.json."
        )
    if isinstance(value, os.PathLike) or not is_plausible_hub_id(text):
        raise ModelNotFoundError(f"{given}: {_missing_folder_message(path)} {_WHAT_TO_PASS}")
    key = (text, kwargs.get("revision"))
    if key in _HUB_IDS_SEEN or _in_hub_cache(text, kwargs):
        return
    offline = _hub_offline(kwargs)
    problem = f"{offline}, so the Hub is not asked" if offline else _hub_problem(text, kwargs)
    if problem is None:
        _HUB_IDS_SEEN.add(key)
        return
    raise ModelNotFoundError(
        f"{given}: neither a folder (no ./{text} in {Path.cwd()}) nor a model in the local Hub cache, and "
        f"{problem}. Pass an existing model folder (check its spelling), or a Hub id while the Hub can be "
        "reached (or fetch it first with `hf download <id>`)."
    )


def check_model_paths(named: Mapping[str, Any], model_kwargs: Mapping[str, Any] | None = None) -> None:
    """:func:`check_model_path` for each ``what: value`` of `named` (None values are skipped), before any
    of them is loaded."""
    for what, value in named.items():
        if value is not None:
            check_model_path(value, what, model_kwargs=model_kwargs)
