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


def repeats_warning(world: int, per_device: int, drop_last: bool, n_examples: int, unit: str) -> str | None:
    """On several processes, an epoch whose examples do not fill its last round of micro-batches (one per rank) has
    that round filled with repeats of the epoch's first examples (accelerate's even batches: every rank must step),
    and the repeats are trained: the epoch's last step is then not the mean over its own examples, and differs from
    the same run on one process (measured: 18 examples, micro-batch 2, 4 ranks: its loss 4.501 against 4.047).
    Masking the repeats is not built yet; this says so where it happens."""
    round_size = world * per_device
    extra = n_examples % round_size
    if world == 1 or drop_last or extra == 0:
        return None
    return (f"hftrain: warning: {n_examples} training {unit} are not a multiple of {world} processes x "
            f"per_device_train_batch_size {per_device} = {round_size}: the last micro-batch of each epoch is "
            f"completed with {round_size - extra} repeats of the epoch's first {unit}, which are trained (the last "
            "step of each epoch differs from the same run on one process); use a multiple of "
            f"{round_size} {unit}")


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
    world_size = max(1, world_size // recipe.strategy.resolved_tensor_parallel())  # tensor-parallel ranks share rows
    problem = batch_problem(world_size, recipe.typed_training.per_device_train_batch_size,
                            recipe.typed_training.gradient_accumulation_steps,
                            recipe.typed_training.dataloader_drop_last, len(data.train))
    if problem:
        raise LaunchError(problem)
    print0(f"hftrain: {len(data.train)} training {method.unit}"
           + (f", {len(data.eval)} held out" if data.eval is not None else ""))
    warning = repeats_warning(world_size, recipe.typed_training.per_device_train_batch_size,
                              recipe.typed_training.dataloader_drop_last, len(data.train), method.unit)
    if warning:
        print0(warning)
    return tokenizer, data
