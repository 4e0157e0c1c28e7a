"""Every path a run loads (model, tokenizer, chat template), checked at once before anything is loaded."""

from __future__ import annotations

from ..config import ModelSection
from .paths import folder_problem, path_problem, pickle_only_problem
from .chat_template import chat_template_problem


def path_problems(cfg: ModelSection, chat_template: str | None = None, key: str = "model") -> list[tuple[str, str]]:
    """(key, message) for model, tokenizer and chat template paths that cannot be loaded: checked before anything
    is loaded (launch.preflight) and again by the loaders. `key`: where the model section sits in the recipe (model,
    or a method's other model, e.g. a teacher's section)."""
    name = f"{key}.name_or_path"
    checks = [(name, path_problem(cfg.name_or_path, name)),
              (name, pickle_only_problem(cfg.name_or_path, name)),
              (name, folder_problem(cfg.name_or_path, name)),
              ("data.chat_template", chat_template_problem(chat_template))]
    if cfg.tokenizer_name_or_path:
        checks.append((f"{key}.tokenizer_name_or_path",
                       path_problem(cfg.tokenizer_name_or_path, f"{key}.tokenizer_name_or_path")))
    return [(key, msg) for key, msg in checks if msg]
