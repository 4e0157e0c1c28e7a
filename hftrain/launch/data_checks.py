"""The data phase `hftrain check`, `hftrain prepare` and the run share: every row read, rendered and tokenised by
the recipe's method, and one optimizer step's worth of rows present."""

from __future__ import annotations

from ..config import Recipe
from ..distributed import print0
from ..errors import LaunchError
from ..methods import method_of
from ..modeling import load_tokenizer


def batch_problem(world: int, per_device: int, accumulation: int, drop_last: bool, n_examples: int) -> str | None:
    """One optimizer step takes world x micro-batch x accumulation examples; fewer than that trains nothing."""
    need = world * per_device * accumulation
    if drop_last and n_examples < need:  # without drop_last a short step still trains
        return (f"one optimizer step needs {need} examples ({world} processes x per_device_train_batch_size "
                f"{per_device} x gradient_accumulation_steps {accumulation}) and dataloader_drop_last drops them "
                f"all: the data has {n_examples}. Lower one of those or add data")
    return None


def check_data(recipe: Recipe, world_size: int, seed: int | None = None):
    """(tokenizer, data): every row read, rendered and tokenised into the datasets cache, or found there (errors name
    the file and row), by the recipe's method (methods.Method.read), and one optimizer step's worth of rows present.
    `hftrain check`, `hftrain prepare` and the run share this phase, so a check or a prepare leaves the run a warm
    cache. With data.streaming the training rows are read as training goes: the first rows of each source are
    checked."""
    tokenizer = load_tokenizer(recipe.model, recipe.data.chat_template)
    seed = recipe.typed_training.seed if seed is None else seed
    method = method_of(recipe)
    data = method.read(recipe, tokenizer, world_size, seed)
    if method.counts_its_steps:
        return tokenizer, data
    if recipe.data.streaming:  # a stream has no length; its first rows were checked (data/stream.py)
        print0("hftrain: training examples streamed" + (f", {len(data.eval)} held out" if data.eval is not None
                                                         else ""))
        return tokenizer, data
    problem = batch_problem(world_size, recipe.typed_training.per_device_train_batch_size,
                            recipe.typed_training.gradient_accumulation_steps,
                            recipe.typed_training.dataloader_drop_last, len(data.train))
    if problem:
        raise LaunchError(problem)
    print0(f"hftrain: {len(data.train)} training {method.unit}"
           + (f", {len(data.eval)} held out" if data.eval is not None else ""))
    return tokenizer, data
