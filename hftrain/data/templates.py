"""Chat templates as hftrain calls them: every call gets the tools and data.chat_template_kwargs, a template's
refusal becomes a DataError naming the row and a fix, and the template's end-of-turn token is checked against the
tokens that stop generation."""

from __future__ import annotations

import json
import os
import re

from huggingface_hub import try_to_load_from_cache
from huggingface_hub.errors import HFValidationError
from jinja2.exceptions import TemplateError

from ..distributed import print0
from ..errors import DataError

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
# What a template (or the data it is handed) can raise: raise_exception's TemplateError, and the TypeError /
# KeyError / ... of a template that meets a message shape it does not expect (a dict where it adds strings).
TEMPLATE_ERRORS = (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)
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


def end_of_turn(tokenizer, kwargs: dict) -> int | None:
    """The id of the special token the template writes right after an assistant turn's content (<|im_end|>,
    <|eot_id|>, <end_of_turn>, </s>), found by rendering a probe conversation; None when the template ends turns
    with ordinary text or cannot render the probe."""
    probe = [{"role": "user", "content": "PING"}, {"role": "assistant", "content": "PONG"}]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False, **kwargs)
    except TEMPLATE_ERRORS:
        return None
    if "PONG" not in text:
        return None
    after = text[text.rindex("PONG") + len("PONG"):]
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    if not ids:
        return None
    special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    return ids[0] if ids[0] in special else None


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


def eos_problem(tokenizer, kwargs: dict) -> str | None:
    """A warning when the template ends assistant turns with a token that does not stop generation."""
    eot = end_of_turn(tokenizer, kwargs)
    if eot is None:
        return None
    ids, said = stop_ids(tokenizer)
    if eot in ids:
        return None
    token = tokenizer.convert_ids_to_tokens(eot)
    return (f"hftrain: warning: the chat template ends each assistant turn with {token!r} (id {eot}), which is "
            f"trained, but generation stops at {said}: the fine-tuned model will write {token!r} and then go on "
            f"instead of stopping. hftrain adds {eot} to eos_token_id in the fine-tuned model's "
            "generation_config.json; for the base model add it to its generation_config.json too, or set the "
            f"tokenizer's eos_token to {token!r}, or use a chat template that ends turns with the eos_token")


def warn_eos_once(tokenizer, kwargs: dict) -> None:
    key = (tokenizer.chat_template, tokenizer.eos_token, getattr(tokenizer, "name_or_path", None),
           json.dumps(kwargs, sort_keys=True, default=str))
    if key in _warned:
        return
    _warned.add(key)
    problem = eos_problem(tokenizer, kwargs)
    if problem:
        print0(problem)


def stop_at_end_of_turn(model, tokenizer, chat_template_kwargs: dict | None = None) -> int | None:
    """Make the model's generation stop where the template ends an assistant turn: the end-of-turn token is added
    to `model.generation_config.eos_token_id` (saved with the fine-tuned model) when it is not there yet. Returns
    the id added, or None."""
    config = getattr(model, "generation_config", None)
    if config is None or not getattr(tokenizer, "chat_template", None):
        return None
    eot = end_of_turn(tokenizer, template_kwargs(tokenizer, chat_template_kwargs))
    ids = config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if eot is None or eot in ids:
        return None
    config.eos_token_id = ids + [eot]
    print0(f"hftrain: generation stops at {tokenizer.convert_ids_to_tokens(eot)!r} (id {eot}) too: added to "
           "generation_config.eos_token_id")
    return eot
