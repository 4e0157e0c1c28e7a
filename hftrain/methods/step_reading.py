"""How a process reward model reads a prompt and its steps: one contract, imported by its training
(methods/reward/step_rows.py) and by GRPO's scoring of rollouts with it (methods/grpo/process_reward_model.py), so
that a step's end is decided once.

- the prompt: a text prompt after the tokenizer's BOS, a conversation rendered with the chat template and its
  generation prompt (the template writes its own special tokens), tokenised alone;
- each step: tokenised alone and followed by the separator's one token (the separator encoded alone), the last step
  too, as TRL's PRMTrainer built its rows; a step's score is read at its separator's token.

Why each piece alone and not the joined text: today's pre-tokenisers merge punctuation with the newline after it
(Qwen2's and Llama 3's read ".\\n" as one piece), so in a joined text the default separator "\\n" had no token of its
own after most steps: training refused such rows, and GRPO's scoring silently read whatever merged token held the
separator's last character. Read this way the separator is always its own token, in training and in scoring alike.
A separator that is not one token by itself is refused (`separator_problem`)."""

from __future__ import annotations

from ..errors import DataError


def separator_ids(tokenizer, separator: str) -> list[int]:
    return tokenizer.encode(separator, add_special_tokens=False)


def separator_problem(tokenizer, separator: str) -> str | None:
    """Why `separator` cannot mark a step's end with this tokenizer (it is not one token by itself), or None."""
    ids = separator_ids(tokenizer, separator)
    if len(ids) != 1:
        return (f"{separator!r} tokenises to {len(ids)} tokens {tokenizer.convert_ids_to_tokens(ids)}, so a step's "
                "end has no one token to carry its label: choose a separator that is a single token (e.g. '\\n')")
    return None


def steps_of(text: str, separator: str) -> list[str]:
    """The steps of a rollout's text: the pieces between separators, blank ones left out (a training row never has
    an empty step)."""
    return [step for step in text.split(separator) if step.strip()]


def prompt_ids(prompt, tokenizer, template_kwargs: dict) -> list[int]:
    """The prompt's ids (the module docstring); a template that refuses it is a DataError."""
    if isinstance(prompt, str):
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        return bos + tokenizer.encode(prompt, add_special_tokens=False)
    try:
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **template_kwargs)
    except Exception as e:  # noqa: BLE001 - the template's own refusal (jinja raise_exception)
        raise DataError(f"the chat template refuses the prompt: {type(e).__name__}: {e}") from None
    return tokenizer.encode(text, add_special_tokens=False)


def step_row(prompt, steps: list[str], tokenizer, separator: str, template_kwargs: dict) -> dict:
    """{input_ids, prompt_tokens, step_ends}: the prompt's ids, then each step's followed by the separator's token;
    step_ends the index of each step's separator token."""
    (sep,) = separator_ids(tokenizer, separator)  # separator_problem refused any other
    ids = prompt_ids(prompt, tokenizer, template_kwargs)
    first, ends = len(ids), []
    for step in steps:
        ids += tokenizer.encode(step, add_special_tokens=False) + [sep]
        ends.append(len(ids) - 1)
    return {"input_ids": ids, "prompt_tokens": first, "step_ends": ends}
