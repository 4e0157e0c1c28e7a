"""What a training method is to the rest of hftrain: its registry entry (methods/registry.py: its name, the section
that selects it, the recipe script that runs it), its data phase and how `hftrain data` shows its rows, its arguments,
and what it adds to the one run (hftrain/lifecycle.py): its model, its trainer and its held-out metrics. The CLI, the
run's set-up, preflight and the run ask the registry instead of branching on names."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Callable, ClassVar

from ..config import ModelSection, Recipe
from ..heads import Head, Role
from ..modeling import load_model
from .registry import MethodEntry


@dataclass(frozen=True)
class ModelSpec:
    """A model a method holds: its role, its head kind, the recipe section it loads from and where that section sits
    in the recipe (`key`: model for the policy, e.g. distill.teacher for a teacher), which every message names."""

    role: Role
    head: Head
    section: ModelSection
    key: str = "model"
    num_labels: int | None = None  # a classifier's classes (a reward model's one score); None: its config's own
    whole: bool = False  # held whole on every rank whatever the strategy (GRPO's reward models, scored on each rank)


@dataclass(frozen=True)
class Method:
    entry: MethodEntry  # its name, section, script (registry.py): what may be known of it before it is imported
    # The data phase before the model loads: (recipe, tokenizer, data-parallel ranks, seed) -> the run's data, every
    # row read and checked (errors name the file and row). `unit`: what a training row is called in messages.
    read: Callable
    unit: str = "examples"
    counts_its_steps: bool = False  # read() checks that one optimizer step's worth is there (else preflight does)
    show: Callable | None = None  # (recipe, tokenizer, n) -> what `hftrain data` prints
    arguments: Callable | None = None  # (recipe, **TrainingArguments values) -> the run's arguments (TRL's config)
    trainer_class: type | None = None
    hub_tag: str | None = None  # the model card's method tag, as the Hub's model pages name methods (default: name)
    # What its policy may read (modality.py, by name: "text", "images"); another is refused by preflight.
    modalities: tuple[str, ...] = ("text",)
    # The held-out metrics reported before and after training, as the trainer's evaluate() names them.
    reported: ClassVar[tuple[str, ...]] = ("eval_loss",)

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def script(self) -> str:
        return self.entry.script

    @property
    def section(self) -> str | None:
        return self.entry.section

    def models(self, recipe: Recipe) -> list[ModelSpec]:
        """The models this method holds, by role and head (default: one causal-LM policy from recipe.model). Loading,
        the memory plan, resume's checks, the upload checks and the card ask the policy's head (`policy`)."""
        return [ModelSpec(Role.POLICY, Head.CAUSAL_LM, recipe.model)]

    def policy(self, recipe: Recipe) -> ModelSpec:
        """The model this method trains."""
        return next(spec for spec in self.models(recipe) if spec.role is Role.POLICY)

    # What the method adds to the run (lifecycle.run); `run` is launch.Run (the recipe, strategy and arguments).
    def model(self, run):
        """The policy, loaded by its head's Auto class (methods with more to set, SFT's packing, override this)."""
        spec = self.policy(run.recipe)
        return load_model(spec.section, head=spec.head)

    def others(self, recipe: Recipe) -> list[ModelSpec]:
        """The models this method holds beside the policy (a reference, a teacher, a reward model): preflight checks
        their paths as it checks the policy's, under their own keys, before anything loads."""
        return [spec for spec in self.models(recipe) if spec.role is not Role.POLICY]

    def load_frozen(self, spec: ModelSpec, packing: bool = False):
        """A model the method holds but does not train (a teacher, a reward model), through the policy's safe path
        (safetensors only, trust_remote_code as its section says, messages naming spec.key): in eval mode, no
        gradients, so no optimizer state is ever made for it. `packing`: it is fed the policy's packed rows, so it is
        loaded with the same options (no KV cache, packed rows joined for a kernel that reads them so): loaded
        without them, every example after the first of a row attended to the ones before it."""
        model = load_model(spec.section, packing=packing, head=spec.head, key=spec.key,
                           num_labels=spec.num_labels).eval()
        model.requires_grad_(False)
        return model

    def load_others(self, run) -> dict:
        """{key: model} of the frozen models the house places (methods/frozen.py FrozenModelsMixin places them): every
        model beside the policy (`others`) but those held whole on each rank (spec.whole: scored on each rank by
        their own code) and a copy of the policy's own section (a reference: its trainer library copies the policy),
        each loaded by load_frozen with the options the policy's rows need (packed rows stay apart)."""
        packing = bool(getattr(run.recipe.data, "packing", False))
        return {spec.key: self.load_frozen(spec, packing=packing) for spec in self.others(run.recipe)
                if not spec.whole and spec.section is not run.recipe.model}

    def trainer(self, run, model, tokenizer, data, callbacks: list):
        raise NotImplementedError

    def metrics(self, run, trainer, data, before: bool) -> dict:
        """Held-out metrics of this method beyond `reported` (e.g. exact match), before or after training."""
        return {}

    def describe(self, recipe: Recipe) -> str:
        """How the model card says the model was made: 'trained by <this> with hftrain'."""
        return self.name

    def card(self, recipe: Recipe) -> dict:
        """The method as run_info.json records it for the model card and the upload checks (hub reads it, naming
        no method): its head, and a classifier's classes (a LoRA adapter's base is built with them)."""
        policy = self.policy(recipe)
        return {"name": self.name, "tag": self.hub_tag or self.name, "description": self.describe(recipe),
                "head": policy.head.value, **({"num_labels": policy.num_labels} if policy.num_labels else {})}


def first_rows(method: Method, recipe: Recipe, tokenizer, n: int, note: str | None = None) -> str:
    """The first n training rows as the trainer gets them, one JSON object per line (pairs, KTO's examples); `note`
    (on stderr) says what they are."""
    data = method.read(recipe, tokenizer, 1, recipe.typed_training.seed)
    if note:
        print(f"hftrain: the first {min(n, len(data.train))} training {note}", file=sys.stderr)
    return "\n".join(json.dumps(data.train[i], ensure_ascii=False) for i in range(min(n, len(data.train))))


def has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))
