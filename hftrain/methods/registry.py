"""The registry of methods: one light entry per method (its name, the recipe section that selects it, the script that
runs it, the module that holds it), so that the CLI, `hftrain check` and the set-up can name and choose a method
without importing its trainer (TRL's trainers load only when a run or a command needs one: `load`).

A method is selected by its section, through a table: the recipe section a method reads names it (its `method`
property: the `preference:` section's loss picks DPO (sigmoid, ipo), SimPO, ORPO or KTO, `grpo:` GRPO); a recipe with
no method section trains with SFT. Two method sections in one recipe is a recipe error naming both (config's rules
say the same when a recipe is checked). The recipe's method sections are read from here too (`section_class`:
methods/recipe.py builds the Recipe with one field per section), so adding a method is its package (its module with
its METHOD, its section) and one entry here; a method outside hftrain registers itself the same way, through the
`hftrain.methods` entry-point group (a MethodEntry: `plugins`)."""

from __future__ import annotations

import dataclasses
import importlib
import sys
from dataclasses import dataclass
from importlib.metadata import entry_points

from ..config import Recipe, RecipeError


@dataclass(frozen=True)
class MethodEntry:
    name: str  # sft, dpo (sigmoid, ipo), simpo, orpo, kto, grpo, outcome_reward
    script: str  # the recipe script that runs it: `hftrain <script>`, hftrain.recipes.<script>
    section: str | None  # the recipe section that selects it (preference, grpo), None for SFT
    example: str | None  # that section as a user writes it, for the refusal of a script run without it
    module: str  # the module whose METHOD (a base.Method) is this method, imported on first use
    section_class: str | None = None  # "module:Class" of the section (a config.MethodSection); None for SFT

    def load_section(self) -> type:
        """The section's class (light: a section module imports no trainer)."""
        module, _, name = self.section_class.partition(":")
        return getattr(importlib.import_module(module), name)

    def load(self):
        """The method itself (base.Method): its module is imported here, on first use, not when the registry is."""
        method = importlib.import_module(self.module).METHOD
        if method.entry != self:
            raise RuntimeError(f"{self.module}.METHOD is {method.entry}, not the registry's {self}")
        return method


_PACKAGE = __name__.rpartition(".")[0]  # hftrain.methods
_PREFERENCE, _GRPO = f"{_PACKAGE}.preference", f"{_PACKAGE}.grpo"  # the families' sub-packages
_REWARD = f"{_PACKAGE}.reward"

_PREFERENCE_SECTION = f"{_PREFERENCE}.preference_section:PreferenceSection"

SFT = MethodEntry("sft", "sft", None, None, f"{_PACKAGE}.sft")
DPO = MethodEntry("dpo", "dpo", "preference", "preference: {loss_type: sigmoid, beta: 0.1}", f"{_PREFERENCE}.dpo",
                  _PREFERENCE_SECTION)
SIMPO = MethodEntry("simpo", "dpo", "preference", "preference: {loss_type: simpo, beta: 2.0}", f"{_PREFERENCE}.simpo",
                    _PREFERENCE_SECTION)
ORPO = MethodEntry("orpo", "dpo", "preference", "preference: {loss_type: orpo, beta: 0.1}", f"{_PREFERENCE}.orpo",
                   _PREFERENCE_SECTION)
KTO = MethodEntry("kto", "dpo", "preference", "preference: {loss_type: kto, beta: 0.1}", f"{_PREFERENCE}.kto",
                  _PREFERENCE_SECTION)
GRPO = MethodEntry("grpo", "grpo", "grpo", "grpo: {rewards: [{function: exact_match}]}", f"{_GRPO}.grpo",
                   f"{_GRPO}.grpo_section:GrpoSection")
REWARD = MethodEntry("outcome_reward", "reward", "reward", "reward: {kind: outcome}", f"{_REWARD}.outcome",
                     f"{_REWARD}.reward_section:RewardSection")

DISTILL = MethodEntry("distill", "distill", "distill", "distill: {teacher: {name_or_path: TEACHER_FOLDER}}",
                      f"{_PACKAGE}.distill.distill", f"{_PACKAGE}.distill.distill_section:DistillSection")

PROCESS_REWARD = MethodEntry("process_reward", "reward", "reward", "reward: {kind: process}", f"{_REWARD}.process",
                             REWARD.section_class)

BUILT_IN: tuple[MethodEntry, ...] = (SFT, DPO, SIMPO, ORPO, KTO, GRPO, REWARD, PROCESS_REWARD, DISTILL)
PLUGIN_GROUP = "hftrain.methods"  # the entry-point group a method outside hftrain registers its MethodEntry in


# The recipe's own sections (model, data, training, ...): no method's section may take one of their keys.
CORE_SECTIONS = frozenset(f.name for f in dataclasses.fields(Recipe))


def _plugin_problem(entry, found: list[MethodEntry]) -> str | None:
    """Why a plugin's entry cannot be a method beside the others, or None."""
    if not isinstance(entry, MethodEntry):
        return f"it is {type(entry).__name__}, not a hftrain.methods.registry.MethodEntry"
    if entry.name in {e.name for e in (*BUILT_IN, *found)}:
        return f"it registers method {entry.name!r}, which is already registered: rename it"
    if entry.section in CORE_SECTIONS or entry.section is None:
        return (f"its section {entry.section!r} is the recipe's own" if entry.section else "it declares no recipe "
                "section to select it (a recipe without one trains with sft)") + ": give it a section of its own"
    owners = {e.section: e for e in (*BUILT_IN, *found) if e.section}
    if entry.section in owners and owners[entry.section].section_class != entry.section_class:
        return f"its section {entry.section!r} is method {owners[entry.section].name!r}'s: give it one of its own"
    entry.load_section()  # a section class that does not import would break the reading of every recipe
    return None


def plugins() -> tuple[tuple[MethodEntry, ...], tuple[str, ...]]:
    """(the methods other packages register: entry points of group `hftrain.methods`, each a MethodEntry; why each
    refused one was left out). A plugin is a guest: one that fails to import, is not a MethodEntry, takes a taken
    name, or a section of the recipe's own or of another method, is left out and named, and the rest of hftrain
    works (it made every command, --help included, end in a traceback, or silently replaced the recipe's data:)."""
    found, refused = [], []
    for point in entry_points(group=PLUGIN_GROUP):
        try:
            entry = point.load()
            problem = _plugin_problem(entry, found)
        except Exception as e:  # noqa: BLE001 - whatever a guest's import raises
            problem = f"it fails to import ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
        if problem:
            refused.append(f"hftrain: the method plugin {point.name} = {point.value} ({PLUGIN_GROUP}) is left out: "
                           f"{problem}")
        else:
            found.append(entry)
    return tuple(found), tuple(refused)


_PLUGINS, REFUSED_PLUGINS = plugins()
for _line in REFUSED_PLUGINS:
    print(_line, file=sys.stderr, flush=True)
# Every method; SFT, the method of a recipe with no method section, first: its script is the default command's.
METHODS: tuple[MethodEntry, ...] = (*BUILT_IN, *_PLUGINS)
BY_NAME = {e.name: e for e in METHODS}  # the table a recipe section's `method` is looked up in
DEFAULT = SFT
SCRIPTS = tuple(dict.fromkeys(e.script for e in METHODS))  # hftrain sft / dpo / grpo


def sections() -> dict[str, type]:
    """Recipe key -> section class, for every method section (the methods sharing a section give one class)."""
    out: dict[str, type] = {}
    for entry in METHODS:
        if entry.section is not None and entry.section not in out:
            out[entry.section] = entry.load_section()
    return out


def entry_of(recipe: Recipe) -> MethodEntry:
    """The entry of the method a recipe trains with: the one its method section names, else SFT's."""
    sections = recipe.method_sections()
    if len(sections) > 1:
        first, *others = sections
        raise RecipeError([f"{recipe.source}: {other}: a recipe trains one method: remove the {first}: section or "
                           "this one" for other in others])
    if not sections:
        return DEFAULT
    key, section = next(iter(sections.items()))
    entry = BY_NAME[section.method]
    if entry.section != key:
        raise RuntimeError(f"the {key}: section names method {entry.name}, whose entry reads {entry.section}:")
    return entry
