"""What the request path reads from a model folder without building the model, and without torch: the
tokenizer the router tokenizes with, the model's context length, and what a PEFT adapter folder says (its
base, an aLoRA's invocation tokens, why it is not an adapter of a given base).

A folder with a `tokenizer.json` is read by `PreTrainedTokenizerFast` (the class transformers' AutoTokenizer
gives such folders, without importing the model classes and torch with them); one without is converted by
AutoTokenizer. `shape://` paths (timing families) use the demo family's tokenizer.
"""
from __future__ import annotations

import json
from pathlib import Path

from scd.online import shapes


def load_tokenizer(path: str | Path):
    """The tokenizer of a model folder or of a `shape://` path, without the model."""
    folder = Path(shapes.TOKENIZER if shapes.is_shape(path) else path).expanduser()
    if (folder / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def context_length(path: str | Path) -> int:
    """The model's context (max_position_embeddings) from its config.json, without the model."""
    if shapes.is_shape(path):
        return int(shapes.SHAPES[shapes.parse(str(path)).name]["max_position_embeddings"])
    config = Path(path).expanduser() / "config.json"
    try:
        return int(json.loads(config.read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{config}: no max_position_embeddings to read ({type(e).__name__}: {e})") from None


def is_adapter(path: str | Path) -> bool:
    """A PEFT adapter folder (adapter_config.json, no config.json of its own)."""
    p = Path(path).expanduser()
    return (p / "adapter_config.json").is_file() and not (p / "config.json").is_file()


def _adapter_config(path: str | Path) -> dict:
    return json.loads((Path(path).expanduser() / "adapter_config.json").read_text())


def named_base(path: str | Path) -> str | None:
    """The base model an adapter's config names (base_model_name_or_path): a local folder or a hub id."""
    return _adapter_config(path).get("base_model_name_or_path")


def invocation_tokens(adapter_dir: str | Path | None) -> tuple[int, ...] | None:
    """An aLoRA adapter's invocation token ids, from its adapter_config.json (None: not an aLoRA, or no adapter)."""
    if adapter_dir is None or not (Path(adapter_dir).expanduser() / "adapter_config.json").is_file():
        return None
    tokens = _adapter_config(adapter_dir).get("alora_invocation_tokens")
    return tuple(int(t) for t in tokens) if tokens else None


def model_problem(path: str | Path, base: str | Path | None = None) -> str | None:
    """Why `path` is neither a model folder (config.json) nor a PEFT adapter folder whose base is a local model
    folder (`base`, or the one its adapter_config.json names), in one line; None when it is one of them."""
    p = Path(path).expanduser()
    if not p.is_dir():
        return f"{path} does not exist" if not p.exists() else f"{path} is not a folder"
    if (p / "config.json").is_file():
        return None
    if not (p / "adapter_config.json").is_file():
        return f"{path} is neither a model folder (config.json) nor a PEFT adapter folder (adapter_config.json)"
    try:
        adapter_base(p, base)
    except (FileNotFoundError, ValueError) as e:
        return str(e)
    return None


def adapter_problem(path: str | Path, base_folder: str | Path, base: str | Path | None = None) -> str | None:
    """Why `path` is not a PEFT adapter of the model in `base_folder` (`base`: the base its config should
    name instead of its own), in one line; None when it is one."""
    p = Path(path).expanduser()
    if not is_adapter(p):
        return f"{path} is not a PEFT adapter folder (adapter_config.json)"
    try:
        named = adapter_base(p, base)
    except (FileNotFoundError, ValueError) as e:
        return str(e)
    if named.resolve() != Path(base_folder).expanduser().resolve():
        return f"{path} is an adapter of {named}, not of {base_folder}"
    return None


def adapter_base(path: str | Path, base: str | Path | None = None) -> Path:
    """The base model folder of an adapter: `base` if given, else the adapter config's base_model_name_or_path,
    which must then be a local folder (nothing is fetched)."""
    p = Path(path).expanduser()
    named = named_base(p)
    b = Path(base if base is not None else (named or "")).expanduser()
    if not str(b) or not (b / "config.json").is_file():
        raise FileNotFoundError(f"the base model of adapter {p} is not a local model folder: {str(b) or '(none named)'}"
                                "; give it with --consumer-base (scd eval, scd bench) or `base:` on the specialist "
                                "in the config")
    return b
