"""The demo's tool (recipes/demo/grpo_tools.yaml): the sum of two whole numbers, which the tiny demo model cannot
work out itself for 5-digit numbers. Its type hints and docstring are the JSON schema the chat template shows."""


def add(a: int, b: int) -> str:
    """Add two whole numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return str(int(a) + int(b))
