"""`python -m hftrain.recipes SCRIPT RECIPE [key=value ...]`: the recipe script of a method registered from outside
hftrain (the `hftrain.methods` entry-point group, methods/registry.py), which has no module here; hftrain's own
methods run as their modules (`-m hftrain.recipes.sft`)."""

import sys

from hftrain.recipes import entry

if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m hftrain.recipes SCRIPT RECIPE [key=value ...]")
    entry(sys.argv[1])(sys.argv[2:])
