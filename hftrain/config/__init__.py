"""The recipe: typed sections, their rules, YAML and command-line loading. Imports nothing else of hftrain but
its constants and errors: every other part receives the typed piece it needs. The methods' own sections are
theirs (hftrain/methods/, config.MethodSection): a recipe is read with the Recipe type that holds them
(methods.load_recipe), and config names no method."""

from ..errors import RecipeError
from .fields import option
from .loading import (
                       build_recipe,
                       load_recipe,
                       parse_overrides,
                       parse_recipe,
                       split_argv,
)
from .rules import recipe_problems
from .strategy_rules import strategy_problems
from .sections import (
                       CompressionSection,
                       DataSection,
                       DataSource,
                       EvalSection,
                       HubSection,
                       LoraSection,
                       MethodSection,
                       ModelSection,
                       MoeSection,
                       Problems,
                       QuantizationSection,
                       Recipe,
                       UpcycleSection,
)
from .strategy import StrategySection, resolved_strategy, strategy_of_deepspeed_config
from .training import (
                       TRAINING_DEFAULTS,
                       HFTrainingArguments,
                       HFTrainOptions,
                       arguments_kwargs,
                       arguments_problem,
)

__all__ = [
    "RecipeError", "option", "build_recipe", "load_recipe", "parse_overrides", "parse_recipe", "split_argv",
    "recipe_problems", "strategy_problems", "CompressionSection", "DataSection", "DataSource", "EvalSection",
    "HubSection", "LoraSection", "MethodSection", "ModelSection", "MoeSection", "Problems", "QuantizationSection",
    "Recipe", "StrategySection", "UpcycleSection",
    "resolved_strategy", "strategy_of_deepspeed_config", "TRAINING_DEFAULTS", "arguments_kwargs",
    "arguments_problem", "HFTrainingArguments", "HFTrainOptions",
]
