"""GRPO's tools: the functions a recipe's `grpo.tools` names, called by TRL 1.16's tool loop (GRPOTrainer's
`tools`: the model's tool calls parsed from its completion, each result appended as a `tool` message whose tokens are
in the context and masked out of the loss, then generation goes on) within limits TRL does not set.

TRL calls a tool directly and turns an exception into an error result, but a tool that hangs hangs the rank, and a
result that is not text is passed through str(). Here each call runs in the user-code guard (user_code.call_user_code:
copies of its arguments, its prints on stderr, grpo.tool_timeout); a call that raises, exits, runs past the limit or
returns no text gives the model one line, "error: ...", and is counted (user_code.CallCounts: tools/errors,
tools/timeouts in the logs; an environment's methods count the same way). A call stuck in C code past the limit ends
the rank, named, by the guard's watchdog. The wrapper keeps the function's name, signature and docstring
(functools.wraps), from which transformers builds the JSON schema the template shows.
"""

from __future__ import annotations

import copy
import functools
import types

from .grpo_section import GrpoSection
from ...constants import IGNORE_INDEX
from ...data.preview import marked
from ...data.templates import stop_ids, template_kwargs
from ...errors import RewardError
from ...evaluate import greedy_continuation, prompt_ids
from .user_code import CallCounts, TimeLimit, UserCodeFailure, call_user_code, import_function, limit_of


def unanswered_calls(completions: list[list[dict]]) -> int:
    """Rollouts (TRL's parsed turns) whose last turn is a tool call that was never run: TRL's loop stopped there, at
    grpo.max_tool_calls or because the answer would pass max_completion_length."""
    return sum(1 for turns in completions if turns and turns[-1].get("tool_calls"))


def text_answer(name: str, result, counts: CallCounts) -> str:
    """A tool's (or an environment method's) result as the model reads it: the text, or an error counted."""
    if isinstance(result, str):
        return result
    counts.errors += 1
    return f"error: {name} returned {type(result).__name__}, not text"


def guarded(fn, limit: TimeLimit | None, counts: CallCounts):
    """`fn` as the model's tool: its result as text, or "error: ..." for a call that fails (see the docstring)."""

    @functools.wraps(fn)
    def tool(*args, **kwargs):
        name = fn.__name__
        try:
            result = call_user_code(fn, f"the tool {name}", args, kwargs, limit=limit, counts=counts)
        except UserCodeFailure as e:  # the model sent arguments the tool refuses, or the tool is broken
            return f"error: {name} {e.reason}"
        return text_answer(name, result, counts)

    return tool


def schema_problem(fn) -> str | None:
    """Why transformers cannot build the tool's JSON schema (a missing type hint or docstring), or None."""
    from transformers.utils import get_json_schema  # heavy import, only where tools are used

    try:
        get_json_schema(fn)
    except Exception as e:  # transformers' DocstringParsingException / TypeHintParsingException
        return f"{type(e).__name__}: {e}"
    return None


def load_tools(g: GrpoSection, counts: CallCounts | None = None) -> list:
    """The recipe's tools, guarded (see the module docstring); a tool without a usable schema is refused naming it."""
    counts = counts if counts is not None else CallCounts()
    out, keys_of_names = [], {}
    for i, spec in enumerate(g.tools or []):
        key = f"grpo.tools.{i}"
        fn = import_function(spec, key)
        problem = schema_problem(fn)
        if problem:
            raise RewardError(f"{key}: {spec}: transformers cannot build its JSON schema ({problem}); give every "
                              "argument a type hint and the function a Google-style docstring with an Args: section")
        if fn.__name__ in keys_of_names:  # the model calls a tool by its name: one of the two could never be called
            raise RewardError(f"{key}: {spec} is named {fn.__name__!r}, as {keys_of_names[fn.__name__]} is: the model "
                              "would see two tools of one name and could call only one; rename one of them")
        keys_of_names[fn.__name__] = key
        out.append(guarded(fn, limit_of(g.tool_timeout, "grpo.tool_timeout"), counts))
    return out


def suffix_after_stop(suffix: list[int], stop_ids, last_generated: int | None) -> list[int]:
    """The tokens TRL appends after a completion that called a tool (its `_get_tool_suffix_ids`: the template's tool
    turn and the next generation prompt), less a first token that stops generation and that the model generated as
    its completion's last token (`last_generated`). A template whose tool call ends where the tool's turn begins
    renders that token in the tool's part (GLM-4.5's <|observation|>, also one of its model's stop tokens): the model
    has already generated it, so TRL's suffix put it in the context twice, unlike the template's rendering of the
    same exchange (tests/test_grpo_tools.py). A turn ended by another stop token (GLM's <|user|>) keeps it: the model
    never wrote it (tests/test_grpo_tool_masks.py)."""
    if suffix and suffix[0] == last_generated and suffix[0] in set(stop_ids):
        return suffix[1:]
    return suffix


def trl_tool_suffix(tokenizer, tool_messages: list[dict], template_kwargs: dict) -> list[int]:
    """What TRL's loop appends after a completion that called tools (GRPOTrainer._get_tool_suffix_ids, on the state
    it reads) for `tool_messages`: the tools' turn and the next generation prompt, as this template renders them."""
    from trl import GRPOTrainer  # heavy; tools only

    trainer = types.SimpleNamespace(processing_class=tokenizer, _tokenizer=tokenizer, chat_template=None,
                                    chat_template_kwargs=template_kwargs, _is_vlm=False)
    return GRPOTrainer._get_tool_suffix_ids(trainer, tool_messages)


def tool_suffix_problem(tokenizer, template_kwargs: dict) -> str | None:
    """Why the template cannot render a tool's answer the way TRL's loop appends it after a tool call, or None: TRL
    renders a short exchange with and without a tool message and raises mid-run where the one is not a prefix of the
    other (Qwen3's own template: its assistant turn renders differently once a tool answers) or where the template
    cannot render parsed arguments (DeepSeek-V3's and R1's own templates concatenate them as text)."""
    try:
        trl_tool_suffix(tokenizer, [{"role": "tool", "name": "tool", "content": "0"}], template_kwargs)
    except Exception as e:  # noqa: BLE001 - the template's or TRL's own error, reported as the reason
        return (f"cannot render a tool's answer after a tool call as TRL's tool loop appends it ({type(e).__name__}: "
                f"{str(e)[:160]}); templates it runs tools with: Qwen2.5's, Qwen3-2507's, Qwen3.5's, GLM-4.5's, "
                "gpt-oss's, LFM2's, Nemotron 3's (set data.chat_template to one the model was trained with)")
    return None


def tool_template_problem(tokenizer, template_kwargs: dict | None = None) -> str | None:
    """Why TRL's tool loop cannot run with this tokenizer's chat template, or None: the template must render a whole
    tool-calling exchange, and TRL must know how to parse the model's tool calls out of it (a response template of
    the families it ships: Qwen2.5/3/3.5, Llama 3.1/3.2, GLM-4.5, gpt-oss, ...), as GRPOTrainer checks when built,
    and render a tool's answer after a call (tool_suffix_problem), which TRL finds out only in the loop."""
    from trl.chat_template_utils import add_response_schema, supports_tool_calling  # heavy; tools only

    if not supports_tool_calling(tokenizer):
        return ("cannot render a tool-calling conversation (user -> assistant with tool_calls -> tool): use the "
                "model family's own template with tool support")
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        try:
            add_response_schema(copy.deepcopy(tokenizer))
        except Exception as e:  # TRL knows no parser for this template
            return (f"is not one whose tool calls TRL can parse ({type(e).__name__}: {str(e)[:160]}): use a family "
                    "TRL ships a response template for (Qwen2.5/3, Llama 3.1/3.2, GLM-4.5, gpt-oss, ...)")
    return tool_suffix_problem(tokenizer, template_kwargs or {})


_PLACEHOLDERS = {"integer": 1, "number": 1.5, "string": "x", "boolean": True, "array": [], "object": {}}


def _example_call(tool) -> dict:
    """A call of `tool` with a placeholder for each argument, as TRL's parser hands it to the loop."""
    from transformers.utils import get_json_schema

    schema = get_json_schema(tool)["function"]
    arguments = {name: _PLACEHOLDERS.get(spec.get("type"), "x")
                 for name, spec in schema["parameters"]["properties"].items()}
    return {"type": "function", "function": {"name": schema["name"], "arguments": arguments}}


def example_trajectory(tokenizer, prompt: list[dict], tools: list, template_kwargs: dict) -> str:
    """`hftrain data`'s view of a tool rollout: `prompt`, a call of the first tool, its answer and a final answer, as
    the model would sample them from this template and TRL's loop (with suffix_after_stop) would train them: the
    trained tokens between [[ and ]], the tool's answer and the prompt outside."""
    call = {"role": "assistant", "content": "", "tool_calls": [_example_call(tools[0])]}
    exchange = [call, {"role": "tool", "name": call["tool_calls"][0]["function"]["name"], "content": "<answer>"},
                {"role": "assistant", "content": "<final answer>"}]
    render = functools.partial(tokenizer.apply_chat_template, tools=tools, tokenize=True, return_dict=False,
                               **template_kwargs)
    start, whole = render(prompt, add_generation_prompt=True), render(prompt + exchange)
    if whole[:len(start)] != start:
        return "  (this template renders a turn in history unlike its generation prompt: no one rendering to show)"
    stops = stop_ids(tokenizer)[0]
    first = _until_stop(whole, len(start), stops)
    suffix = suffix_after_stop(trl_tool_suffix(tokenizer, exchange[1:2], template_kwargs), stops,
                               first[-1] if first else None)
    second = _until_stop(whole, len(start) + len(first) + len(suffix), stops)
    ids = start + first + suffix + second
    labels = [IGNORE_INDEX] * len(start) + first + [IGNORE_INDEX] * len(suffix) + second
    return marked(tokenizer, ids, labels)


def _until_stop(ids: list[int], start: int, stops) -> list[int]:
    """The tokens the model samples from `start`: up to and including the first that stops generation."""
    for i in range(start, len(ids)):
        if ids[i] in stops:
            return ids[start:i + 1]
    return ids[start:]


class ToolAnswer:
    """A held-out example's greedy answer over several turns with the recipe's tools (eval.exact_match of a GRPO
    recipe with grpo.tools): the model's tool calls parsed as TRL's loop parses them, the guarded tools run, their
    answers appended as the loop appends them (TRL's suffix, less a generated stop token), up to `rounds` rounds;
    the answer is the content of the last turn. Measured without the tools, the model's answer was its first tool
    call, never the reference. Under lockstep every rank calls generate() rounds + 1 times per example, whatever
    its turns (a finished answer's extra generations are discarded): each generation is a collective there."""

    def __init__(self, tools: list, rounds: int):
        self.tools, self.rounds = tools, rounds
        self.by_name = {t.__name__: t for t in tools}
        self._for = None  # (tokenizer, its copy with TRL's response parser, its stop ids): made once, not per example

    def _parser_and_stops(self, tokenizer):
        from trl.chat_template_utils import add_response_schema

        if self._for is None or self._for[0] is not tokenizer:
            self._for = (tokenizer, add_response_schema(copy.deepcopy(tokenizer)), stop_ids(tokenizer)[0])
        return self._for[1:]

    def __call__(self, model, tokenizer, example: dict, max_new_tokens: int, synced: bool = False,
                 chat_template_kwargs: dict | None = None) -> str:
        from trl.chat_template_utils import parse_response

        parser, stops = self._parser_and_stops(tokenizer)
        kwargs = template_kwargs(tokenizer, chat_template_kwargs)
        ids, answer, done = prompt_ids(tokenizer, example, chat_template_kwargs, self.tools), "", False
        for turn in range(self.rounds + 1):
            if done and not synced:
                break
            new = greedy_continuation(model, tokenizer, ids, max_new_tokens, synced)
            if done:
                continue
            parsed = parse_response(parser, new, prefix=ids, tools=self.tools)
            answer, calls = parsed.get("content") or "", parsed.get("tool_calls")
            done = not calls or turn == self.rounds
            if not done:
                ids = ids + new + self._answers(tokenizer, calls, kwargs, stops, new[-1] if new else None)
        return answer

    def _answers(self, tokenizer, calls: list[dict], kwargs: dict, stops, last_generated: int | None) -> list[int]:
        messages = []
        for call in calls:
            name, arguments = call["function"]["name"], call["function"].get("arguments") or {}
            tool = self.by_name.get(name)
            said = tool(**arguments) if tool is not None else f"error: there is no tool {name}"
            messages.append({"role": "tool", "name": name, "content": said})
        return suffix_after_stop(trl_tool_suffix(tokenizer, messages, kwargs), stops, last_generated)
