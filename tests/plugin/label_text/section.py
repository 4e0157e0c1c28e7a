"""The stand-in's recipe section, `label_text:`, and its rule (a config.MethodSection, as hftrain's own)."""

from dataclasses import dataclass

from hftrain.config import MethodSection, Problems, Recipe, option


@dataclass
class LabelTextSection(MethodSection):
    HELP = "A stand-in method: rows {text, label} trained on a sequence-classification head."

    text_column: str = option("text", "The column holding the text.")
    label_column: str = option("label", "The column holding the class (0 or 1).")

    @property
    def method(self) -> str:
        return "label_text"

    def problems(self, recipe: Recipe) -> Problems:
        if self.text_column == self.label_column:
            return [("label_text.label_column", "must differ from label_text.text_column")]
        return []
