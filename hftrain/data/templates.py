"""Chat templates as hftrain calls them: every call gets the tools and data.chat_template_kwargs, a template's
refusal becomes a DataError naming the row and a fix, and the tokens the template ends a turn with are checked
against the tokens that stop generation (and added to the fine-tuned model's)."""

from __future__ import annotations

import json
import os
import re

from huggingface_hub import try_to_load_from_cache
from huggingface_hub.errors import HFValidationError

from ..distributed import print0
from ..errors import DataError
from .forms import TEMPLATE_ERRORS, forms

# Templates that write today's date (Llama 3.2/3.3: strftime_now) get this one unless chat_template_kwargs sets
# date_string, so the token ids of a row do not change with the day they are tokenised. It is the date Llama 3.1's
# own template writes when none is given.
FIXED_DATE = "26 Jul 2024"
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
# apply_chat_template's own arguments: a chat_template_kwargs key of the same name would collide with hftrain's call.
RESERVED_KWARGS = frozenset({"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                             "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                             "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
                             "sanitize_control_tokens"})
_warned: set = set()  # EOS warnings already printed in this process (one per template and tokenizer)


def where(source: str | None, row) -> str:
    """'data.sources.0 (train.jsonl), row 3': the place a message about one example names (the row when the
    canonical example carries one)."""
    return f"{source or 'data'}" + (f", row {row}" if row is not None else "")


def template_kwargs(tokenizer, kwargs: dict | None) -> dict:
    """data.chat_template_kwargs as passed to every apply_chat_template call, with the date pinned."""
    kw = dict(kwargs or {})
    clash = sorted(RESERVED_KWARGS & kw.keys())
    if clash:
        raise DataError(f"data.chat_template_kwargs: {clash} are arguments hftrain sets itself (tools come from each "
                        "row's 'tools'); remove them from data.chat_template_kwargs")
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    if "strftime_now" in template and "date_string" in template and "date_string" not in kw:
        kw["date_string"] = FIXED_DATE
    return kw


def _fix_for(message: str) -> str:
    low = message.lower()
    if "system" in low:
        return ("merge the system message into the first user turn, or set data.chat_template to a template that "
                "supports a system role")
    if "alternate" in low:
        return ("make the roles alternate user/assistant (merge consecutive messages of one role; tool calls and "
                "results need a template that supports tools), or set data.chat_template to a template that allows it")
    return "fix the row, or set data.chat_template to a template that renders it"


def apply(tokenizer, messages: list[dict], tools, kwargs: dict, at: str, **call):
    """tokenizer.apply_chat_template with the row's tools and the recipe's kwargs; refusals become DataError."""
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, **call, **kwargs)
    except TEMPLATE_ERRORS as e:
        msg = str(e) or type(e).__name__
        raise DataError(f"{at}: the chat template refused the conversation: {msg}. Fix: {_fix_for(msg)}") from e


def has_generation_marker(tokenizer) -> bool:
    template = tokenizer.chat_template
    return isinstance(template, str) and bool(GENERATION_MARKER.search(template))


def _first_special(tokenizer, text: str) -> int | None:
    """The id of the first token of `text` when it is a special (or added) token, else None."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
    special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    return ids[0] if ids and ids[0] in special else None


def end_of_turn_ids(tokenizer, kwargs: dict) -> list[int]:
    """The special tokens that end an assistant turn as the template writes it, found by rendering probe
    conversations: the one right after a turn's content (<|im_end|>, <|eot_id|>, <end_of_turn>, </s>); for a
    template that writes nothing after a turn and lets the next message's role token end it (GLM-4-MoE), the token
    it writes first when a user message follows (<|user|>) and when a tool result follows a tool call
    (<|observation|>). Empty when the template ends turns with ordinary text or cannot render the probe."""
    probe = [{"role": "user", "content": "PING"}, {"role": "assistant", "content": "PONG"}]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False, **kwargs)
    except TEMPLATE_ERRORS:
        return []
    if "PONG" not in text:
        return []
    after = text[text.rindex("PONG") + len("PONG"):]
    if after:
        first = _first_special(tokenizer, after)
        return [] if first is None else [first]
    f = forms(tokenizer, kwargs)
    return list(dict.fromkeys(t for t in (_first_special(tokenizer, f.after_turn),
                                          _first_special(tokenizer, f.after_call)) if t is not None))


def _generation_config(name_or_path: str) -> str | None:
    """The generation_config.json beside the tokenizer: in its folder, or in the Hub cache (never downloaded)."""
    if not name_or_path:
        return None
    if os.path.isdir(name_or_path):
        path = os.path.join(name_or_path, "generation_config.json")
        return path if os.path.isfile(path) else None
    try:
        path = try_to_load_from_cache(name_or_path, "generation_config.json")
    except HFValidationError:  # neither a folder nor a Hub id
        return None
    return path if isinstance(path, str) else None


def stop_ids(tokenizer) -> tuple[set[int], str]:
    """The ids that end generation: the tokenizer's eos_token and, when there is a generation_config.json beside
    the tokenizer, its eos_token_id (an int or a list); and a description of where they come from."""
    ids, said = set(), []
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
        said.append(f"the tokenizer's eos_token {tokenizer.eos_token!r} (id {tokenizer.eos_token_id})")
    path = _generation_config(str(getattr(tokenizer, "name_or_path", "") or ""))
    if path is not None:
        with open(path, encoding="utf-8") as fh:
            eos = json.load(fh).get("eos_token_id")
        if eos is not None:
            ids.update(eos if isinstance(eos, list) else [eos])
            said.append(f"{path}'s eos_token_id {eos}")
    note = "" if path else " (no generation_config.json found beside the tokenizer)"
    return ids, (" and ".join(said) or "no eos token") + note


def turn_stop_ids(tokenizer, kwargs: dict) -> set[int]:
    """The tokens a trained turn ends with: those that stop generation (stop_ids) and those the template ends a
    turn with (end_of_turn_ids; stop_at_end_of_turn makes the fine-tuned model stop at them too)."""
    return stop_ids(tokenizer)[0] | set(end_of_turn_ids(tokenizer, kwargs))


def eos_problem(tokenizer, kwargs: dict) -> str | None:
    """A warning when the template ends assistant turns with tokens that do not stop generation."""
    ids, said = stop_ids(tokenizer)
    missing = [t for t in end_of_turn_ids(tokenizer, kwargs) if t not in ids]
    if not missing:
        return None
    tokens = " / ".join(repr(tokenizer.convert_ids_to_tokens(t)) for t in missing)
    numbers = f"{'ids' if len(missing) > 1 else 'id'} {', '.join(map(str, missing))}"
    return (f"hftrain: warning: the chat template ends each assistant turn with {tokens} ({numbers}), which is "
            f"trained, but generation stops at {said}: the model will write {tokens} and then go on instead of "
            f"stopping. hftrain adds {missing} to eos_token_id in the fine-tuned model's generation_config.json; for "
            "the base model add them to its generation_config.json too, or set the tokenizer's eos_token, or use a "
            "chat template that ends turns with the eos_token")


def warn_eos_once(tokenizer, kwargs: dict) -> None:
    key = (tokenizer.chat_template, tokenizer.eos_token, getattr(tokenizer, "name_or_path", None),
           json.dumps(kwargs, sort_keys=True, default=str))
    if key in _warned:
        return
    _warned.add(key)
    problem = eos_problem(tokenizer, kwargs)
    if problem:
        print0(problem)


def stop_at_end_of_turn(model, tokenizer, chat_template_kwargs: dict | None = None) -> list[int]:
    """Make the model's generation stop where the template ends an assistant turn: the end-of-turn tokens
    (end_of_turn_ids) are added to `model.generation_config.eos_token_id` (saved with the fine-tuned model) when they
    are not there yet. Returns the ids added."""
    config = getattr(model, "generation_config", None)
    if config is None or not getattr(tokenizer, "chat_template", None):
        return []
    ends = end_of_turn_ids(tokenizer, template_kwargs(tokenizer, chat_template_kwargs))
    ids = config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    added = [t for t in ends if t not in ids]
    if added:
        config.eos_token_id = ids + added
        print0(f"hftrain: generation stops at {tokenizer.convert_ids_to_tokens(added)} (ids {added}) too: added to "
               "generation_config.eos_token_id")
    return added
