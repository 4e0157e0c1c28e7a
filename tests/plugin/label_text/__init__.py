"""A stand-in method from outside hftrain (tests/test_method_plugin.py): text classification on a sequence-
classification head, registered through the `hftrain.methods` entry-point group (hftrain/methods/registry.py), with
no edit of hftrain. It proves the house: a method whose model is not a causal LM is its own package plus one registry
entry; this module is that entry and stays light (the registry imports it while it is itself being imported)."""

from hftrain.methods.registry import MethodEntry

ENTRY = MethodEntry("label_text", "label_text", "label_text", "label_text: {text_column: text}",
                    "label_text.method", "label_text.section:LabelTextSection")
