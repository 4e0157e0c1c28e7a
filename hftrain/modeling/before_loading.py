"""Every path a run loads (model, tokenizer, chat template), checked at once before anything is loaded."""

from __future__ import annotations

from ..config import ModelSection
from .paths import _folder_problem, _path_problem, _pickle_only_problem
from .chat_template import _chat_template_problem


def path_problems(cfg: ModelSection, chat_template: str | None = None) -> list[tuple[str, str]]:
    """(key, message) for model, tokenizer and chat template paths that cannot be loaded: checked before anything
    is loaded (launch.preflight) and again by the loaders."""
    checks = [("model.name_or_path", _path_problem(cfg.name_or_path, "model.name_or_path")),
              ("model.name_or_path", _pickle_only_problem(cfg.name_or_path)),
              ("model.name_or_path", _folder_problem(cfg.name_or_path, "model.name_or_path")),
              ("data.chat_template", _chat_template_problem(chat_template))]
    if cfg.tokenizer_name_or_path:
        checks.append(("model.tokenizer_name_or_path",
                       _path_problem(cfg.tokenizer_name_or_path, "model.tokenizer_name_or_path")))
    return [(key, msg) for key, msg in checks if msg]
