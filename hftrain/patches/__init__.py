"""Every run-time change hftrain makes to a library, one module per library.

Each module opens with what it changes, why, the upstream version it was written against, and how to tell when it
can go. Nothing here is applied on import: `launch.setup` (or the trainer, for the two that belong to one Trainer)
calls each function by name, and every function is idempotent.
"""
