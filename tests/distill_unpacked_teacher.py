"""The negative control of tests/test_distill.py::test_packed_rows_distill_as_padded_ones, as a matrix variant
(tests/matrix_worker.py runs main(argv)): the teacher loaded without the packing options though it is fed packed rows
(what the run did before frozen models were loaded for their inputs)."""

from hftrain.methods.base import Method
from hftrain.recipes.distill import main as distill_main


def main(argv):
    load_frozen = Method.load_frozen
    Method.load_frozen = lambda self, spec, packing=False: load_frozen(self, spec)
    try:
        return distill_main(argv)
    finally:
        Method.load_frozen = load_frozen
