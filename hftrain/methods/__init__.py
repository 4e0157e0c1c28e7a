"""The training methods, one package each (preference/: DPO and IPO, SimPO, ORPO, KTO; grpo/; reward/: outcome and
process reward models; distill/), SFT a module (sft.py); each owns its trainer, its TRL config where it has one, its
recipe section with its rules, its data phase and how `hftrain data` shows its rows (base.Method). Shared here, at the
top: base.py (Method, ModelSpec: every model a method holds, by role and head), modality.py (what the policy reads,
text or images, and everything that follows from it), policy.py (the policy and LoRA config of the TRL-based
methods), frozen.py (a frozen model placed as the strategy places the policy), reward_reading.py (how a reward model
reads a prompt and its answer and where its score is, for training and GRPO scoring alike), pairs.py (prompt / chosen
/ rejected rows), recipe.py (the Recipe: config's sections and one per method section, and how every recipe is read).

registry.py is what the CLI, the run's set-up and preflight ask: each method's light entry, selected by the recipe
section that names it (`entry_of`). A method's module, and the trainer library it imports (TRL), loads only when
`method_of` is asked for the method itself: `hftrain --help`, `config` and `check` of an SFT recipe import no TRL
trainer. Adding a method is a package here (its module with its METHOD, its section) and its entry in registry.py
(the entry names the section too: recipe.py builds the Recipe from the registry); a method outside hftrain registers
its entry in the `hftrain.methods` entry-point group and is a guest (registry.plugins: one that cannot be a method is
left out and named)."""

from ..heads import Head
from .base import Method, ModelSpec
from .grpo.grpo_section import GrpoSection, RewardSpec
from .preference.preference_section import PreferenceSection
from .recipe import Recipe, load_recipe, parse_recipe
from .registry import DEFAULT, METHODS, SCRIPTS, MethodEntry, entry_of

DEFAULT_SCRIPT = DEFAULT.script  # the script of the method that takes a recipe with no method section


def method_of(recipe: Recipe) -> Method:
    """The method a recipe trains with (the one its preference: or grpo: section names, else SFT), its module
    imported now."""
    return entry_of(recipe).load()


def policy_head(recipe: Recipe) -> Head:
    """The head of the model the recipe's method trains (Method.models): what loading, the memory plan, resume's
    checks, the upload checks and the card ask instead of assuming a causal LM."""
    return method_of(recipe).policy(recipe).head


__all__ = ["METHODS", "SCRIPTS", "DEFAULT_SCRIPT", "Method", "MethodEntry", "ModelSpec", "entry_of", "method_of",
           "policy_head", "Recipe", "load_recipe", "parse_recipe", "GrpoSection", "PreferenceSection", "RewardSpec"]
