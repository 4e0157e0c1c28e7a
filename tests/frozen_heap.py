"""Freezes the interpreter's heap as it is now (`gc.freeze()`): the objects the imports made leave the collector's
view, so a full collection no longer walks them. Its import freezes: tests/forked.py's server imports it last of its
preload (every forked launch inherits the frozen heap); conftest, which imports it early, calls freeze() again once
collection has imported the test modules.

Why: a full collection of an interpreter that imported torch, transformers, TRL and DeepSpeed walks about 700,000
objects, 0.37 s on the suite's 2-core machine, and a run makes several (hftrain.distributed.shutdown before the gloo
group goes, accelerate's free_memory at the end of train, the collector's own full passes); frozen, 10 us. The
objects frozen are the imports' (modules, classes, functions), which live until exit anyway; the garbage among them
is collected first."""

import gc


def freeze() -> None:
    gc.collect()
    gc.freeze()


freeze()  # on import: the forked launches' server imports this module last of its preload
