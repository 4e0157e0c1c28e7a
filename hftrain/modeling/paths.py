"""A model folder checked before anything loads: a local path that does not exist, pickle-only weights, a folder cut
short, and what model.trust_remote_code would run; the refusal the loaders raise."""

from __future__ import annotations

import hashlib
import json
import os
import sys

from transformers import AutoConfig

from ..config import ModelSection
from ..distributed import print0
from ..errors import ModelError
from ..fileio import safetensors_problem


def path_problem(name_or_path: str, key: str) -> str | None:
    # A Hub id is "name" or "org/name"; anything else is a local path, and a missing one is a typo, not a download.
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if looks_local and not os.path.exists(os.path.expanduser(name_or_path)):
        return f"{key}: {name_or_path} does not exist (a local path; check the spelling or build it first)"
    return None


def pickle_only_problem(path: str, key: str = "model.name_or_path") -> str | None:
    """A local folder with pickle weights only: say why it is refused and how to convert it."""
    if not os.path.isdir(path):
        return None
    names = os.listdir(path)
    pickles = sorted(n for n in names if n.endswith((".bin", ".pt", ".pth")))
    if pickles and not any(n.endswith(".safetensors") or n.endswith(".safetensors.index.json") for n in names):
        return (f"{key}: {path} holds pickle weights only ({', '.join(pickles[:3])}); hftrain loads "
                "safetensors only, because unpickling a file can run code. If you trust the file, convert it once: "
                "load it with its transformers Auto class and save it (AutoModelFor<its head>.from_pretrained(path)"
                ".save_pretrained(path) writes model.safetensors)")
    return None


def folder_problem(path: str, key: str) -> str | None:
    """A local model folder whose config.json does not parse, or whose safetensors files are not whole (a copy or a
    download cut short): named before anything is loaded, rather than as a loader's traceback minutes later."""
    folder = os.path.expanduser(path)
    if not os.path.isdir(folder):
        return None
    config = os.path.join(folder, "config.json")
    if os.path.isfile(config):
        try:
            with open(config, encoding="utf-8") as fh:
                if not isinstance(json.load(fh), dict):
                    raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            return f"{key}: {config} is not a readable JSON object ({e}); restore the folder or save it again"
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            problem = safetensors_problem(os.path.join(folder, name))
            if problem:
                return f"{key}: {problem}; restore the folder or save it again"
    return None


def remote_code(name_or_path: str) -> list[str]:
    """What trust_remote_code will run from a local folder: its auto_map classes (config.json,
    tokenizer_config.json) and its .py files with the start of their sha256 (to compare with what you reviewed)."""
    folder = os.path.expanduser(name_or_path)
    if not os.path.isdir(folder):
        return []
    found = []
    for name in ("config.json", "tokenizer_config.json"):
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as fh:
                auto_map = json.load(fh).get("auto_map") or {}
        except (OSError, ValueError, AttributeError):
            continue
        for cls, ref in sorted(auto_map.items()):
            found.append(f"{name} auto_map {cls} -> {ref if isinstance(ref, str) else ', '.join(map(str, ref))}")
    for f in sorted(os.listdir(folder)):
        if f.endswith(".py"):
            with open(os.path.join(folder, f), "rb") as fh:
                found.append(f"{f} (sha256 {hashlib.sha256(fh.read()).hexdigest()[:12]})")
    return found


_warned: set[str] = set()


def warn_remote_code(cfg: ModelSection, name: str) -> None:
    """model.trust_remote_code runs Python shipped with the checkpoint: say what, once per folder or Hub id."""
    if not cfg.trust_remote_code or name in _warned:
        return
    _warned.add(name)
    code = remote_code(name)
    shown = "".join(f"\n  - {c}" for c in code) if code else (
        " (a Hub id: the code is downloaded with it; read it on the Hub at the revision you pin with model.revision)")
    print0(f"hftrain: warning: model.trust_remote_code is true: loading {name} runs the Python code shipped with it"
           f"{shown}", file=sys.stderr)


def raise_if(problem: str | None) -> None:
    if problem:
        raise ModelError(problem)


def resolved_name_or_path(name_or_path: str) -> str:
    """A local folder as an absolute path, a Hub id as it is. The model is loaded from this: peft records it as the
    adapter's base_model_name_or_path (adapter_config.json), and a relative one would not load from elsewhere."""
    local = os.path.expanduser(name_or_path)
    return os.path.abspath(local) if os.path.isdir(local) else name_or_path


def local_config(cfg: ModelSection):
    """The model's config from local files only (a folder, or the Hub cache), or None when it cannot be read here:
    path_problems or the loader then says why. For checks that build the model on the meta device."""
    try:
        return AutoConfig.from_pretrained(cfg.name_or_path, revision=cfg.revision,
                                          trust_remote_code=cfg.trust_remote_code, local_files_only=True)
    except Exception:  # noqa: BLE001 - any reason: the checks that need it are skipped, the others report it
        return None
