"""Reading a recipe: YAML file, then `key=value` overrides, then the typed sections, every problem collected.

Precedence is defaults < YAML < command line. Problems name the key as the user spelled it and where it came
from (the file, or `command line`).
"""

from __future__ import annotations

import dataclasses
import os
import typing
from typing import Any

import yaml

from ..errors import RecipeError
from .rules import recipe_problems
from .schema import Ctx, build, unknown
from .sections import (
    CompressionSection,
    DataSection,
    EvalSection,
    HubSection,
    MethodSection,
    ModelSection,
    MoeSection,
    Recipe,
    StrategySection,
)
from .training import TRAINING_REFUSED, validate_training

SECTIONS = {
    "model": ModelSection,
    "data": DataSection,
    "training": dict,
    "strategy": StrategySection,
    "eval": EvalSection,
    "compression": CompressionSection,
    "hub": HubSection,
    "moe": MoeSection,
}


def method_section_types(recipe_type: type[Recipe]) -> dict[str, type]:
    """The methods' sections a Recipe subclass adds (methods.Recipe): recipe key -> its MethodSection class."""
    hints = typing.get_type_hints(recipe_type)
    out = {}
    for f in dataclasses.fields(recipe_type):
        kinds = typing.get_args(hints[f.name]) or (hints[f.name],)
        section = next((k for k in kinds if isinstance(k, type) and issubclass(k, MethodSection)), None)
        if section is not None:
            out[f.name] = section
    return out


MAX_RECIPE_BYTES = 1 << 20  # a recipe is a page of YAML; data lives in data files
MAX_RECIPE_NODES = 100_000  # values after alias expansion: a few aliases can expand to billions (an alias bomb)


class _RecipeLoader(yaml.SafeLoader):
    """safe_load, except that a key given twice in one mapping is an error naming both lines (YAML keeps the last
    silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' appears twice in one mapping (lines {seen[key] + 1} and "
                    f"{key_node.start_mark.line + 1}); keep one", key_node.start_mark)
            if isinstance(key, (str, int, float, bool)):
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def _node_count_exceeds(tree: Any, cap: int) -> bool:
    """Whether the tree, with every alias expanded, holds more than `cap` values (stops counting at the cap)."""
    stack, n = [tree], 0
    while stack:
        node = stack.pop()
        n += 1
        if n > cap:
            return True
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def _list_index(node: list, part: str, dotted: str) -> int:
    idx = int(part)
    if not 0 <= idx <= len(node):  # the next free index appends; anything further would invent entries
        raise RecipeError([f"command line: {dotted}: index {idx} is out of range: the list has {len(node)} "
                           f"entr{'y' if len(node) == 1 else 'ies'}, so use 0..{len(node)} ({len(node)} appends one)"])
    return idx


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node: Any = tree
    for i, part in enumerate(parts[:-1]):
        nxt = parts[i + 1]
        if isinstance(node, list):
            idx = _list_index(node, part, dotted)
            if idx == len(node):
                node.append({})
            node = node[idx]
            continue
        if part not in node or not isinstance(node[part], (dict, list)):
            node[part] = [] if nxt.isdigit() else {}
        node = node[part]
    last = parts[-1]
    if isinstance(node, list):
        idx = _list_index(node, last, dotted)
        if idx == len(node):
            node.append({})
        node[idx] = value
    else:
        node[last] = value


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """`section.key=value`, `--section.key value` and `--section.key=value`; values are parsed as YAML scalars."""
    out, problems, i = [], [], 0
    while i < len(args):
        a = args[i]
        if a.startswith("--"):
            body = a[2:]
            if "=" in body:
                key, raw = body.split("=", 1)
            elif i + 1 < len(args):
                key, raw = body, args[i + 1]
                i += 1
            else:
                problems.append(f"command line: '{a}' has no value; write {body}=VALUE")
                i += 1
                continue
        elif "=" in a:
            key, raw = a.split("=", 1)
        else:
            problems.append(f"command line: '{a}' is not an override; write section.key=value "
                            "(e.g. training.max_steps=10)")
            i += 1
            continue
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        out.append((key, value))
        i += 1
    if problems:
        raise RecipeError(problems)
    return out


def read_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise RecipeError([f"{path}: recipe file not found"])
    if os.path.getsize(path) > MAX_RECIPE_BYTES:
        raise RecipeError([f"{path}: {os.path.getsize(path)} bytes is not a recipe (at most {MAX_RECIPE_BYTES}); "
                           "put data in data files and name them in data.sources"])
    with open(path, "rb") as fh:
        data = fh.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise RecipeError([f"{path}:{line}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8"]) from None
    try:
        raw = yaml.load(text, Loader=_RecipeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        what = "" if isinstance(e, yaml.constructor.ConstructorError) else "YAML syntax error: "
        raise RecipeError([f"{where}: {what}{getattr(e, 'problem', None) or e}"]) from None
    if _node_count_exceeds(raw, MAX_RECIPE_NODES):
        raise RecipeError([f"{path}: expands to more than {MAX_RECIPE_NODES} values (YAML aliases repeat what they "
                           "point to); write the recipe out without nested aliases"])
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RecipeError([f"{path}: a recipe is a mapping of sections (model:, data:, training:, ...), "
                           f"got {type(raw).__name__}"])
    return raw


def _refuse_hub_token(raw: dict, ctx: Ctx) -> dict:
    for name in ("token", "hub_token"):
        if name in raw:
            ctx.add(f"hub.{name}", "not accepted here: " + TRAINING_REFUSED["hub_token"])
    return {k: v for k, v in raw.items() if k not in ("token", "hub_token")}


def build_recipe(tree: dict, source: str = "<dict>", origins: dict[str, str] | None = None, *,
                 recipe_type: type[Recipe]) -> tuple[Recipe, list[str]]:
    """The typed recipe from a tree of sections, and every problem the recipe alone shows (types, unknown keys,
    rules across sections): 'origin: key: message' each. `recipe_type` is Recipe with the methods' sections
    (methods.Recipe): config knows no method's section by itself."""
    ctx = Ctx(source, origins or {})
    sections = {**SECTIONS, **method_section_types(recipe_type)}
    built: dict[str, Any] = {}
    for name, value in tree.items():
        if name not in sections:
            unknown(str(name), str(name), list(sections), ctx)
            continue
        # an optional section, written as `moe: null` by to_yaml
        if value is None and (name == "moe" or name not in SECTIONS):
            continue
        if not isinstance(value, dict):
            ctx.add(name, f"expected a mapping of keys, got {value!r}")
            continue
        if name == "training":
            built[name] = validate_training(value, ctx)
        elif name == "hub":
            built[name] = build(HubSection, _refuse_hub_token(value, ctx), name, ctx)
        else:
            built[name] = build(sections[name], value, name, ctx)
    for name in ("model", "data"):
        if name not in tree:
            ctx.add(name, "required section is missing")
    recipe = recipe_type(
        model=built.get("model"),
        data=built.get("data"),
        training=built["training"] if "training" in built else validate_training({}, ctx),
        strategy=built.get("strategy") or StrategySection(),
        eval=built.get("eval") or EvalSection(),
        compression=built.get("compression") or CompressionSection(),
        hub=built.get("hub") or HubSection(),
        moe=built.get("moe"),
        source=source,
        origins=dict(origins or {}),
        **{name: built.get(name) for name in sections if name not in SECTIONS},
    )
    mistyped = set(ctx.keys)  # a value of the wrong type (or not finite) is not judged again by the rules
    for key, msg in recipe_problems(recipe):
        if key not in mistyped:
            ctx.add(key, msg)
    recipe.invalid = frozenset(ctx.keys)
    return recipe, ctx.problems


def parse_recipe(path: str | None, overrides: list[str] | None = None, raw: dict | None = None, *,
                 recipe_type: type[Recipe]) -> tuple[Recipe, list[str]]:
    """Read a recipe file (or `raw` dict) and apply command-line overrides: the recipe and its problems. Raises
    only when there is nothing to check (no file, a YAML syntax error, a malformed override)."""
    tree = read_yaml(path) if path is not None else dict(raw or {})
    origins: dict[str, str] = {}
    for key, value in parse_overrides(overrides or []):
        try:
            _set_dotted(tree, key, value)
        except RecipeError:
            raise
        except (ValueError, TypeError, AttributeError):
            raise RecipeError([f"command line: cannot set '{key}'"]) from None
        origins[key] = "command line"
    return build_recipe(tree, path or "<dict>", origins, recipe_type=recipe_type)


def load_recipe(path: str | None, overrides: list[str] | None = None, raw: dict | None = None, *,
                recipe_type: type[Recipe]) -> Recipe:
    """parse_recipe, raising every problem at once. The launch adds its environment's (launch.preflight)."""
    recipe, problems = parse_recipe(path, overrides, raw, recipe_type=recipe_type)
    if problems:
        raise RecipeError(problems)
    return recipe


def split_argv(argv: list[str]) -> tuple[str, list[str]]:
    """A recipe script's arguments: the recipe path, then overrides."""
    if not argv or argv[0].startswith("-") or "=" in argv[0]:
        raise RecipeError(["usage: <recipe.yaml> [section.key=value ...] (the recipe path comes first)"])
    return argv[0], argv[1:]
