"""The recipe: typed sections, their rules, YAML and command-line loading. Imports nothing else of hftrain but
its constants and errors: every other part receives the typed piece it needs."""

from ..errors import RecipeError
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
                       GrpoSection,
                       HubSection,
                       LoraSection,
                       ModelSection,
                       MoeSection,
                       PreferenceSection,
                       QuantizationSection,
                       Recipe,
                       RewardSpec,
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
    "RecipeError", "build_recipe", "load_recipe", "parse_overrides", "parse_recipe", "split_argv",
    "recipe_problems", "strategy_problems", "CompressionSection", "DataSection", "DataSource", "EvalSection",
    "GrpoSection", "RewardSpec", "HubSection", "LoraSection", "ModelSection", "MoeSection", "PreferenceSection",
    "QuantizationSection", "Recipe", "StrategySection", "UpcycleSection",
    "resolved_strategy", "strategy_of_deepspeed_config", "TRAINING_DEFAULTS", "arguments_kwargs",
    "arguments_problem", "HFTrainingArguments", "HFTrainOptions",
]
