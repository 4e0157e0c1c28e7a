"""The registry (hftrain/methods/registry.py): a method is selected by the recipe section that names it, through a
table, not by the order methods are asked in; two method sections in one recipe is an error naming both; each
entry's module holds the method that entry describes."""

import pytest

from hftrain.config import RecipeError
from hftrain.methods import METHODS, entry_of, method_of, parse_recipe
from hftrain.methods.preference.preference_section import METHOD_OF_LOSS
from hftrain.methods.registry import BY_NAME

BASE = {"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d.jsonl"}]},
        "training": {"output_dir": "out"}}


def recipe_with(**sections):
    recipe, _ = parse_recipe(None, raw={**BASE, **sections})
    return recipe


@pytest.mark.parametrize("loss, method", [("sigmoid", "dpo"), ("ipo", "dpo"), ("simpo", "simpo"), ("orpo", "orpo"),
                                          ("kto", "kto")])
def test_the_preference_section_s_loss_selects_the_method(loss, method):
    assert entry_of(recipe_with(preference={"loss_type": loss})).name == method


def test_grpo_selects_grpo_and_no_method_section_sft():
    assert entry_of(recipe_with(grpo={"rewards": [{"function": "exact_match"}]})).name == "grpo"
    assert entry_of(recipe_with()).name == "sft"
    assert method_of(recipe_with()).name == "sft"


@pytest.mark.parametrize("sections", [("preference", "grpo"), ("grpo", "preference")])
def test_two_method_sections_are_an_error_naming_both(sections):
    values = {"preference": {"loss_type": "kto"}, "grpo": {"rewards": [{"function": "exact_match"}]}}
    recipe = recipe_with(**{s: values[s] for s in sections})
    with pytest.raises(RecipeError) as raised:
        entry_of(recipe)
    assert "preference:" in str(raised.value) and "grpo:" in str(raised.value)


def test_every_loss_names_a_preference_method():
    assert {BY_NAME[m].section for m in METHOD_OF_LOSS.values()} == {"preference"}


@pytest.mark.parametrize("entry", METHODS, ids=[e.name for e in METHODS])
def test_each_entry_s_module_holds_its_method(entry):
    method = entry.load()
    assert (method.entry, method.name, method.script, method.section) == (entry, entry.name, entry.script,
                                                                          entry.section)
