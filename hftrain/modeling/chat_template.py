"""The chat template data.chat_template names: template text, a .jinja file, or trl:NAME (a template TRL ships)."""

from __future__ import annotations

import importlib.util
import os

from .paths import raise_if


TRL_TEMPLATE = "trl:"  # data.chat_template: trl:NAME is TRL's shipped chat_templates/NAME.jinja


def chat_template_file(chat_template: str | None) -> str | None:
    """The .jinja file data.chat_template names: a path, or trl:NAME for a template TRL ships (its training
    variants, with {% generation %} markers, are trl:NAME_training); None for template text."""
    if chat_template and chat_template.startswith(TRL_TEMPLATE):
        spec = importlib.util.find_spec("trl")
        folder = os.path.join(spec.submodule_search_locations[0], "chat_templates") if spec else ""
        return os.path.join(folder, chat_template[len(TRL_TEMPLATE):] + ".jinja")
    return chat_template if chat_template and chat_template.endswith(".jinja") else None


def chat_template_problem(chat_template: str | None, key: str = "data.chat_template") -> str | None:
    path = chat_template_file(chat_template)
    if path and not os.path.isfile(path):
        if chat_template.startswith(TRL_TEMPLATE):
            folder = os.path.dirname(path)
            names = sorted(n[:-6] for n in os.listdir(folder) if n.endswith(".jinja")) if os.path.isdir(folder) else []
            return (f"{key}: TRL ships no template {chat_template!r} (trl:NAME, NAME one of: "
                    f"{', '.join(names) or 'none: is trl installed?'})")
        return (f"{key}: {chat_template} does not exist; give an existing .jinja file or the template "
                "itself as a string")
    return None


def chat_template_text(chat_template: str, key: str = "data.chat_template") -> str:
    """The template a .jinja path or trl:NAME names, or `chat_template` itself (template text)."""
    raise_if(chat_template_problem(chat_template, key))
    path = chat_template_file(chat_template)
    if not path:
        return chat_template
    with open(path, encoding="utf-8") as fh:
        return fh.read()
