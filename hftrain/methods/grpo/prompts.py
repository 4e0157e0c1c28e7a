"""GRPO's prompts: every row of any supported layout as the prompt the policy answers and its reference answer, each
row checked before any model is loaded.

A conversation (messages, sharegpt, alpaca with a chat template) is its turns up to the last assistant turn, the
reference that turn's text; one that ends on a user turn is a prompt without a reference (rewards that need one say
so). A prompt_completion row (and alpaca without a template) is the prompt text and the completion. Text rows hold no
prompt and are refused. Rows are read by the same layouts as supervised fine-tuning (data/layouts.py: `columns:`,
`roles:`, errors naming the file and row); the prompt is what TRL's GRPOTrainer renders: a conversation with the chat
template, data.chat_template_kwargs and the generation prompt, a text as the tokenizer encodes it. A prompt longer
than data.max_length - grpo.max_completion_length tokens is an error naming its row, or dropped with
data.truncation: drop.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import datasets

from ...config import DataSection, DataSource
from ...distributed import print0
from ...errors import DataError
from ...data.layouts import read_canonical
from ...data.source_loop import read_sources
from ...data.templates import apply, template_kwargs
from .tools import example_trajectory

PROMPT, REFERENCE = "prompt", "reference"  # the columns TRL reads (the prompt) and passes to reward functions


@dataclass
class PromptData:
    train: Any  # datasets.Dataset of prompt (text, or a list of {role, content}) and reference (text or None)
    eval: None  # no evaluation dataset for the Trainer: GRPO is judged by exact match on eval_examples
    eval_examples: list[dict]  # held-out {messages | prompt, reference} for evaluate.exact_match
    conversational: bool


def prompt_of(canon: dict) -> dict:
    """{prompt, reference} of one canonical example (data/layouts.py); a DataError says what is wrong."""
    if "text" in canon:
        raise DataError("a text row holds no prompt to answer; GRPO reads messages, sharegpt, alpaca or "
                        "prompt_completion rows (the prompt, and the reference answer)")
    if "prompt" in canon:
        if not canon["prompt"].strip():
            raise DataError("the prompt is empty; give it the text to answer or remove the row")
        return {PROMPT: canon["prompt"], REFERENCE: canon["completion"]}
    if canon.get("tools"):
        raise DataError("has tools: GRPO here samples plain answers (no tool calls); remove the tools column")
    msgs = canon["messages"]
    for i, m in enumerate(msgs):
        if m["role"] == "tool" or m.get("tool_calls"):
            raise DataError(f"messages[{i}] is a tool call or result: GRPO here samples plain answers; remove "
                            "tool turns from its prompts")
    last = msgs[-1]["role"] == "assistant"
    prompt = [{"role": m["role"], "content": m["content"]} for m in (msgs[:-1] if last else msgs)]
    if not any(m["role"] != "system" for m in prompt):
        raise DataError("the conversation has no turn before the answer: give it the user's turn (the prompt)")
    return {PROMPT: prompt, REFERENCE: msgs[-1]["content"] if last else None}


def _prompt_tokens(tokenizer, prompt, kwargs: dict, at: str, tools: list | None = None) -> int:
    """Tokens of the prompt as TRL's GRPOTrainer 1.16 renders it (_tokenize_prompts), with the schemas of the tools
    the template shows the model (grpo.tools, the environment's methods), which count against data.max_length."""
    if isinstance(prompt, str):
        return len(tokenizer(text=prompt)["input_ids"])
    return len(apply(tokenizer, prompt, tools or None, kwargs, at, add_generation_prompt=True, tokenize=True,
                     return_dict=True)["input_ids"])


def read_prompts(src, key: str, tokenizer, cfg: DataSection, max_completion_length: int,
                 needs_reference: str | None = None, tools: list | None = None) -> list[tuple[str, dict, int]]:
    """(where, prompt row, prompt tokens) of every kept row of one source; the first bad row stops, naming the file
    and row. `needs_reference`: the reward that compares with the reference (a row without one is refused);
    `tools`: the tools the template shows in each prompt (their schemas are measured with it)."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    fmt, rows = read_canonical(src, key, has_template)
    kwargs = template_kwargs(tokenizer, cfg.chat_template_kwargs)
    room = cfg.max_length - max_completion_length
    out, kinds, dropped = [], {}, 0
    for where, canon in rows:
        try:
            row = prompt_of(canon)
        except DataError as e:
            raise DataError(f"{key}: {where}: {e}") from None
        if needs_reference and row[REFERENCE] is None:
            raise DataError(f"{key}: {where}: has no reference answer (the conversation ends on a user turn), which "
                            f"{needs_reference} compares with; give the row its answer or use other rewards")
        conversational = isinstance(row[PROMPT], list)
        kinds.setdefault(conversational, where)
        if len(kinds) > 1:
            raise DataError(f"{key}: {where}: is {'a conversation' if conversational else 'text'} but "
                            f"{kinds[not conversational]} is {'text' if conversational else 'a conversation'}; put "
                            "each kind in a source of its own")
        if conversational and not has_template:
            raise DataError(f"{key}: conversation prompts need a chat template and the tokenizer has none; set "
                            "data.chat_template (a Jinja string or a .jinja file)")
        n = _prompt_tokens(tokenizer, row[PROMPT], kwargs, f"{key} ({where})", tools)
        if n > room:
            if cfg.truncation != "drop":
                shown = " with the tools' schemas" if tools else ""
                raise DataError(f"{key}: {where}: the prompt is {n} tokens{shown} and data.max_length "
                                f"{cfg.max_length} - grpo.max_completion_length {max_completion_length} leaves {room}: "
                                "raise data.max_length, shorten the prompt, or set data.truncation: drop to drop such "
                                "rows")
            dropped += 1
            continue
        out.append((where, row, n))
    if not out:
        raise DataError(f"{key}: every prompt of {src.path} is longer than {room} tokens (data.max_length - "
                        "grpo.max_completion_length)")
    print0(f"hftrain: {key} ({src.path}): layout {fmt}, {len(out)} prompts"
           + (f" ({dropped} longer than {room} tokens dropped)" if dropped else ""), file=sys.stderr)
    return out


def _eval_examples(rows: list[dict]) -> list[dict]:
    """Held-out prompts with a reference, as evaluate.exact_match takes them."""
    key = lambda p: "messages" if isinstance(p, list) else "prompt"  # noqa: E731
    return [{key(r[PROMPT]): r[PROMPT], REFERENCE: r[REFERENCE]} for r in rows if r[REFERENCE] is not None]


def build_prompt_data(cfg: DataSection, tokenizer, max_completion_length: int, seed: int = 42,
                      exact_match: int = 0, needs_reference: str | None = None, tools: list | None = None
                      ) -> PromptData:
    """Every source read and checked, held-out prompts split off (data.eval_fraction) or read (data.eval_sources),
    the training sources mixed by weight."""
    kinds: dict = {}

    def read(src: DataSource, key: str, group: str) -> datasets.Dataset:
        rows = [row for _, row, _ in read_prompts(src, key, tokenizer, cfg, max_completion_length,
                                                  needs_reference if group == "sources" else None, tools)]
        conversational = isinstance(rows[0][PROMPT], list)
        kinds.setdefault(conversational, key)
        if len(kinds) > 1:
            raise DataError(f"{key}: holds {'conversation' if conversational else 'text'} prompts but "
                            f"{kinds[not conversational]} holds the other kind; use one kind in a run")
        return datasets.Dataset.from_list(rows)

    split = read_sources(cfg, seed, read)
    held = [row for part in split.held for row in part]
    examples = _eval_examples(held)[:exact_match]
    if exact_match and not examples:
        raise DataError("eval.exact_match: no held-out prompt has a reference answer to compare with; give the "
                        "held-out rows their answers (the last assistant turn, or the completion)")
    return PromptData(split.train, None, examples, bool(kinds.get(True)))


def preview_prompts(cfg: DataSection, tokenizer, max_completion_length: int, examples: int = 2,
                    tools: list | None = None) -> str:
    """`hftrain data` for GRPO: per source its layout, prompt token counts, and `examples` prompts rendered as the
    policy receives them (chat template, the tools it shows, generation prompt), each with its reference answer."""
    kwargs = template_kwargs(tokenizer, cfg.chat_template_kwargs)
    lines = []
    for prefix, sources in (("data.sources", cfg.sources), ("data.eval_sources", cfg.eval_sources)):
        for i, src in enumerate(sources):
            key = f"{prefix}.{i}"
            rows = read_prompts(src, key, tokenizer, cfg, max_completion_length, tools=tools)
            n = sorted(t for _, _, t in rows)
            lines += [f"{key} ({src.path}): {len(rows)} prompts, "
                      f"{sum(r[REFERENCE] is not None for _, r, _ in rows)} with a reference answer",
                      f"  prompt tokens: min {n[0]}, median {n[len(n) // 2]}, max {n[-1]}; completions of up to "
                      f"{max_completion_length} tokens are sampled"]
            for where, row, t in rows[:examples]:
                prompt = row[PROMPT] if isinstance(row[PROMPT], str) else apply(
                    tokenizer, row[PROMPT], tools or None, kwargs, f"{key} ({where})", add_generation_prompt=True,
                    tokenize=False)
                lines += [f"  --- {where}: {t} prompt tokens", prompt, f"  reference: {row[REFERENCE]!r}"]
            if tools and rows and isinstance(rows[0][1][PROMPT], list):
                lines += ["  --- a tool rollout as it is trained (placeholders; the trained tokens between [[ and ]])",
                          example_trajectory(tokenizer, rows[0][1][PROMPT], tools, kwargs)]
    return "\n".join(lines)
