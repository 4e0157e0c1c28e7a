"""hftrain: fine-tune LLMs on the Hugging Face stack from one YAML recipe."""

__version__ = "0.1.0"
