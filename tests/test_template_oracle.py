"""hftrain's labels against an oracle, token by token, for the chat template families of tests/template_families.py:
every template TRL ships a training variant of (its *_training.jinja: the template with {% generation %} markers,
which transformers' apply_chat_template(..., return_assistant_tokens_mask=True) masks), every family of
tests/data/templates (oracles in tests/data/templates/oracles), and GLM-4.5 without its generation_config.json. Each
family renders the rows below with its own template through hftrain (rows read as from a file, by hftrain's
layouts), and with its oracle through transformers.

Two checks, both strict:
- per turn: each assistant turn's trained tokens equal the oracle's for that turn as the oracle writes it when the
  turn is the last message, or as it writes it in the whole conversation;
- per conversation: every token of every example a row becomes, at its place in the text: hftrain's example text is
  the oracle's text of the same messages, each assistant turn is trained in exactly one example, no token outside
  the turns an example trains is trained, and inside them a token is trained by hftrain exactly when the oracle
  trains it.
The differences allowed, each asserted by its place: tokens of the generation prompt that the oracle trains (the
model is given them: the "\\n" after <|im_start|>assistant, DeepSeek's <｜Assistant｜>); whitespace the oracle trains
after the token that stops generation (the model never writes it: generation has ended; Qwen's "\\n" after
<|im_end|>); and a stop token of the family's generation config that hftrain trains at the end of a turn and the
oracle leaves out (the model writes it to stop: Gemma 4's <|tool_response>). Anything else fails, named.

Where hftrain refuses a row, either the template itself refuses it, or the test checks on its own that the template
loses some of its text (a tool call, reasoning, content): no silent mis-render either way. hftrain's labels are also
the same with the tokenizer's post-processor trimming offsets or not.

`pytest tests/test_template_oracle.py -s` prints a row per family and the figure (docs/templates.md)."""

import json

import pytest

from hftrain.constants import IGNORE_INDEX
from hftrain.data import to_messages_or_text, tokenize_examples
from hftrain.data.forms import REASONING_FIELDS, template_messages
from hftrain.data.render import label, render_examples
from hftrain.data.templates import TEMPLATE_ERRORS, template_kwargs
from hftrain.errors import DataError

from .template_families import FAMILIES, tokenizer_for

TOOL = {"name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"name": "local_time", "description": "Local time of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TOOLS = [{"type": "function", "function": TOOL}, {"type": "function", "function": TIME}]
U1, U2, U3 = ({"role": "user", "content": c} for c in ("Weather in Paris?", "And tomorrow?", "Thanks, bye."))
A1, A2, A3 = ({"role": "assistant", "content": c} for c in ("It is sunny.", "Rain.", "Good night."))
SYSTEM = {"role": "system", "content": "Be brief."}


def call(name="get_weather", arguments=None, bare=False, id="call_1"):
    fn = {"name": name, "arguments": {"city": "Paris"} if arguments is None else arguments}
    return fn if bare else {"type": "function", "id": id, "function": fn}


def result(content="sunny", name="get_weather", id="call_1"):
    return {"role": "tool", "name": name, "tool_call_id": id, "content": content}


def calling(*calls, content="", **extra):
    return {"role": "assistant", "content": content, "tool_calls": list(calls), **extra}


def thinking(content, reasoning):
    return {"role": "assistant", "content": content, "reasoning_content": reasoning}


CONVERSATIONS = {  # name: (messages, tools) as a row of a messages file holds them
    "single": ([U1, A1], None),
    "system": ([SYSTEM, U1, A1], None),
    "multi_turn": ([U1, A1, U2, A2, U3, A3], None),
    "empty_turns": ([U1, {"role": "assistant", "content": ""}, {"role": "user", "content": ""},
                     {"role": "assistant", "content": "Still here."}], None),
    "trailing_user": ([U1, A1, U2], None),
    "tool_call": ([SYSTEM, U1, calling(call()), result(), A1], TOOLS),
    "tool_call_string_args": ([U1, calling(call(arguments='{"city": "Paris"}')), result(), A1], TOOLS),
    "bare_tools": ([U1, calling(call(bare=True)), result(), A1], [TOOL, TIME]),
    "parallel_calls": ([U1, calling(call(), call("local_time", id="call_2")), result(),
                        result("21:05", "local_time", "call_2"), A1], TOOLS),
    "reasoning": ([U1, thinking("It is sunny.", "I should look it up.")], None),
    "reasoning_multi_turn": ([U1, thinking("It is sunny.", "Let me think."), U2, thinking("Rain.", "Clouds."),
                              U3, thinking("Good night.", "They are leaving.")], None),
    "reasoning_tools": ([U1, calling(call(), reasoning_content="I should look it up."), result(),
                         thinking("It is sunny.", "The tool says sunny."), U2, thinking("Rain.", "Clouds.")], TOOLS),
    "inline_think": ([U1, {"role": "assistant", "content": "<think>\nLet me think.\n</think>\n\nIt is sunny."}, U2,
                      {"role": "assistant", "content": "<think>\nClouds.\n</think>\n\nRain."}], None),
    "content_parts": ([{"role": "user", "content": [{"type": "text", "text": "Weather "},
                                                    {"type": "text", "text": "in Paris?"}]},
                       {"role": "assistant", "content": [{"type": "text", "text": "It is sunny."}]}], None),
    "unicode": ([{"role": "user", "content": "Café ? 東京 は 晴れ 🌞"},
                 {"role": "assistant", "content": "Oui — 晴れ 🌞, naïve résumé."}], None),
    "whitespace": ([{"role": "user", "content": "2 + 3 ="},
                    {"role": "assistant", "content": "2 + 3 = 5.\n\n  - indented\n\ttab  and  double  spaces"}], None),
}
TIME_CALL, TIME_RESULT = call("local_time", id="call_2"), result("21:05", "local_time", "call_2")
CONVERSATIONS.update({
    "tools_multi_turn": ([U1, calling(call()), result(), A1, U2, calling(TIME_CALL), TIME_RESULT, A2], TOOLS),
    "tool_call_null_content": ([U1, {"role": "assistant", "content": None, "tool_calls": [call()]}, result(), A1],
                               TOOLS),
})
# Rows of other layouts, as their files hold them: a glaive-function-calling row in ShareGPT form (a function_call
# turn as JSON text, an observation, tools as JSON text of bare schemas).
SHAREGPT = {
    "glaive_tools": {"conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": json.dumps({"weather": "sunny"})},
        {"from": "gpt", "value": "It is sunny."}], "tools": json.dumps([TOOL, TIME])},
}
ROWS = [*CONVERSATIONS, *SHAREGPT]


def canonical(conv: str) -> dict:
    """The row as hftrain reads it from a file (its layout's canonical form)."""
    if conv in SHAREGPT:
        return to_messages_or_text(SHAREGPT[conv], "sharegpt", True)
    raw, tools = CONVERSATIONS[conv]
    return to_messages_or_text({"messages": raw, **({"tools": tools} if tools else {})}, "messages", True)


def _common(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((k for k in range(n) if a[k] != b[k]), n)


def _runs(labels: list[int]) -> list[list[int]]:
    runs, run = [], []
    for lab in labels + [IGNORE_INDEX]:
        if lab != IGNORE_INDEX:
            run.append(lab)
        elif run:
            runs, run = runs + [run], []
    return runs


def _texts(m: dict) -> list[str]:
    """Every line of a message's text, reasoning and tool calls: what its rendering must hold."""
    content = m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"])
    out = [ln.strip() for ln in (content + "\n" + m.get("reasoning_content", "")).splitlines() if ln.strip()]
    for c in m.get("tool_calls") or []:
        args = c["function"]["arguments"]
        out += [c["function"]["name"], *(json.loads(args) if isinstance(args, str) else args).values()]
    return out


def _holds(text: str, piece: str) -> bool:
    return any(v in text for v in (piece, json.dumps(piece, ensure_ascii=False)[1:-1], json.dumps(piece)[1:-1]))


class Rendering:
    """A template's text of a conversation's first n messages, and where each assistant turn is in it."""

    def __init__(self, tok, msgs, tools, kwargs):
        self.tok, self.msgs, self.tools, self.kwargs = tok, msgs, tools, kwargs

    def render(self, n: int, **kw) -> str:
        return self.tok.apply_chat_template(self.msgs[:n], tools=self.tools, tokenize=False, **kw, **self.kwargs)

    def region(self, i: int, n: int, text: str | None = None) -> tuple[int, int, int]:
        """(where message i's generation prompt begins, where it ends, where the turn ends) in the text of the first
        n messages (or `text`, that text with what follows the last message)."""
        text = self.render(n) if text is None else text
        base, prompted = self.render(i), self.render(i, add_generation_prompt=True)
        if text.startswith(base):
            begin, prompt = len(base), _common(prompted, text)
        else:  # the template writes earlier messages differently once message i follows: find where it begins
            gen = prompted[_common(base, prompted):]
            other = self.tok.apply_chat_template(self.msgs[:i] + [_other_words(self.msgs[i])], tools=self.tools,
                                                 tokenize=False, **self.kwargs)
            begin = text.rfind(gen, 0, _common(text, other))
            assert gen and begin >= 0, f"message {i} not found in the template's text"
            prompt = begin + len(gen)
        end = _common(self.render(i + 1), text) if i + 1 < n else len(text)
        return begin, prompt, end


class Oracle(Rendering):
    """The oracle template's text and mask."""

    def __init__(self, tok, msgs, tools, kwargs):
        super().__init__(tok, msgs, tools, kwargs)
        self._encoded: dict = {}

    def encoded(self, n: int) -> tuple[list[int], list[int], list[tuple[int, int]]]:
        """(ids, the oracle's mask, character offsets) of the first n messages."""
        if n not in self._encoded:
            text = self.render(n)
            enc = self.tok.apply_chat_template(self.msgs[:n], tools=self.tools, return_dict=True,
                                               return_assistant_tokens_mask=True, **self.kwargs)
            plain = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
            assert enc["input_ids"] == plain["input_ids"]
            self._encoded[n] = (list(enc["input_ids"]), list(enc["assistant_masks"]), plain["offset_mapping"])
        return self._encoded[n]

    def turn(self, i: int, whole: bool) -> tuple[list[int], list[int]]:
        """(tokens the oracle trains for message i that lie in its generation prompt, the others), in the whole
        conversation or in the conversation that ends with message i."""
        n = len(self.msgs) if whole else i + 1
        begin, prompt, end = self.region(i, n)
        ids, mask, offsets = self.encoded(n)
        prompt_part, rest = [], []
        for t, m, (a, b) in zip(ids, mask, offsets):
            if m and b > begin and a < end:
                (prompt_part if b <= prompt else rest).append(t)
        return prompt_part, rest


def _other_words(m: dict) -> dict:
    """The message with other words in place of its text, reasoning and tool names."""
    other = dict(m, content="zzz" if isinstance(m["content"], str) else [{"type": "text", "text": "zzz"}])
    for name in REASONING_FIELDS:
        if other.get(name):
            other[name] = "zzz"
    if other.get("tool_calls"):
        other["tool_calls"] = [dict(c, function=dict(c["function"], name="zzz")) for c in other["tool_calls"]]
    return other


def _lost(tok, msgs, tools, kwargs, at) -> str | None:
    """The first text of the conversation its own template does not write (checked here, not by hftrain): an
    assistant's in the conversation that ends with it (its reasoning under any field name), any other in the whole
    conversation; None when every text is written."""
    plain = template_messages([{k: v for k, v in m.items() if k != "reasoning_content"} for m in msgs], tok, kwargs,
                              at)
    spellings = [plain] + [[dict(p, **{f: m["reasoning_content"]}) if "reasoning_content" in m else p
                            for p, m in zip(plain, msgs)] for f in REASONING_FIELDS]

    def render(ms):
        try:
            return tok.apply_chat_template(ms, tools=tools, tokenize=False, **kwargs)
        except TEMPLATE_ERRORS:  # a template that cannot render the conversation writes none of it
            return ""

    full = render(plain)
    for i, m in enumerate(msgs):
        texts = [full]
        if m["role"] == "assistant":
            texts = [render(s[:i + 1]) for s in spellings]
            texts = [t[_common(render(s[:i]), t):] for s, t in zip(spellings, texts)]
        for piece in _texts(m):
            if not any(_holds(t, str(piece)) for t in texts):
                return f"message {i}: {str(piece)[:30]!r}"
    return None


def _generation_prompt(tok, msgs, i, tools, kwargs) -> str:
    base = tok.apply_chat_template(msgs[:i], tools=tools, tokenize=False, **kwargs)
    prompted = tok.apply_chat_template(msgs[:i], tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)
    return prompted[_common(base, prompted):]


def _turn_differences(ours: list[int], prompt_part: list[int], rest: list[int], stops: set[int], tok) -> set | None:
    """The allowed differences between hftrain's trained tokens of one turn and the oracle's (prompt_part: those the
    oracle trains inside the generation prompt; rest: the others): "prompt" (the oracle also trains tokens of the
    generation prompt), "stop" (hftrain also trains the stop token that ends the turn), "after_stop" (the oracle also
    trains whitespace after that stop token). None for any other difference."""
    found = {"prompt"} if prompt_part else set()
    if ours == rest:
        return found
    if ours[:-1] == rest and ours[-1] in stops:
        return found | {"stop"}
    if rest[:len(ours)] == ours and ours and ours[-1] in stops and tok.decode(rest[len(ours):]).strip() == "":
        return found | {"after_stop"}
    return None


TURN_COUNTS = ("turns", "exact", "prompt", "after_stop", "stop", "whole")
TOKEN_COUNTS = ("examples", "trained", "oracle", "agree", "prompt", "after_stop", "stop")


def _check_turns(at: str, canon: dict, examples, outs, oracle: Oracle, stops: set[int], tok, kwargs) -> dict:
    """Per turn: each trained turn equals the oracle's, as the turn is the last message or in the whole conversation."""
    counts = dict.fromkeys(TURN_COUNTS, 0)
    own = template_messages(canon["messages"], tok, kwargs, at)
    for ex, out in zip(examples, outs):
        runs = _runs(out["labels"])
        assert len(runs) == len(ex.turns), f"{at}: {len(runs)} runs of trained tokens for turns {ex.turns}"
        for i, ours in zip(ex.turns, runs):
            counts["turns"] += 1
            counts["ends"] = counts.get("ends", set()) | {tok.decode(ours[-1:])}  # for the table of docs/templates.md
            said = tok.decode(ours)
            given = _generation_prompt(tok, own, i, canon.get("tools"), kwargs)  # the model's given: "<think>\n"
            missing = [p for p in _texts(canon["messages"][i]) if not _holds(given + said, str(p))]
            assert not missing, f"{at}: turn {i} trained without {missing}: {said!r}"
            for whole in (False, True):
                found = _turn_differences(ours, *oracle.turn(i, whole), stops, tok)
                if found is not None:
                    for kind in found:
                        counts[kind] += 1
                    counts["exact"] += not found
                    counts["whole"] += whole
                    break
            else:
                pytest.fail(f"{at}: turn {i}: hftrain trains {said!r}, the oracle "
                            f"{tok.decode(oracle.turn(i, False)[1])!r}")
    return counts


def _token_kind(t: int, ours: bool, theirs: bool, in_prompt: bool, after_stop: bool, follows_oracle: bool,
                stops: set[int], tok) -> str:
    """One token of a turn: trained by both ("agree"), or an allowed difference (_turn_differences), or "silent"."""
    if ours and theirs:
        return "agree"
    if theirs and in_prompt:
        return "prompt"
    if theirs and after_stop and tok.decode([t]).strip() == "":
        return "after_stop"
    if ours and t in stops and follows_oracle:
        return "stop"
    return "silent"


def _in(region: tuple[int, int, int], offsets) -> list[int]:
    """The tokens (by index) whose characters overlap a turn's region."""
    return [k for k, (a, b) in enumerate(offsets) if b > region[0] and a < region[2]]


def _check_example(at: str, ex, out: dict, n: int, renderings: tuple, stops: set[int], tok, counts: dict) -> list[str]:
    """Every token of one example against the oracle's mask of the same messages; the silent differences, named."""
    own, oracle = renderings
    ids, mask, offsets = oracle.encoded(n)
    ours_offsets = tok(ex.text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    trained = {k for k, lab in enumerate(out["labels"]) if lab != IGNORE_INDEX}
    counts["trained"] += len(trained)
    silent, covered = [], set()
    for i in ex.turns:
        region = oracle.region(i, n)
        theirs, ours = _in(region, offsets), _in(own.region(i, n, ex.text), ours_offsets)
        if ours[-1] + 1 < len(ours_offsets) and out["input_ids"][ours[-1] + 1] in stops:
            ours.append(ours[-1] + 1)  # the next role's token that ends the turn in generation (GLM's <|user|>)
        covered.update(theirs)
        assert [ids[k] for k in theirs] == [out["input_ids"][k] for k in ours], (
            f"{at}: turn {i}: hftrain's text {tok.decode([out['input_ids'][k] for k in ours])!r}, the oracle's "
            f"{tok.decode([ids[k] for k in theirs])!r}")
        after_stop = False
        for k, h in zip(theirs, ours):
            t, o, trains = ids[k], bool(mask[k]), h in trained
            trained.discard(h)
            counts["oracle"] += o
            if not (o or trains):
                after_stop = False
                continue
            kind = _token_kind(t, trains, o, offsets[k][1] <= region[1], after_stop, k > 0 and bool(mask[k - 1]),
                               stops, tok)
            if kind == "silent":
                silent.append(f"turn {i}: {tok.decode([t])!r} trained by {'hftrain' if trains else 'the oracle'} only")
            else:
                counts[kind] += 1
            after_stop = (trains and t in stops) or kind == "after_stop"
    silent += [f"{tok.decode([out['input_ids'][k]])!r} at token {k}: trained outside the turns"
               for k in sorted(trained)]
    silent += _oracle_outside(ex, n, oracle, covered, tok, counts)
    return [f"example of turns {ex.turns}: {s}" for s in silent]


def _oracle_outside(ex, n: int, oracle: Oracle, covered: set[int], tok, counts: dict) -> list[str]:
    """The oracle's trained tokens outside the turns this example trains: allowed where their run of trained tokens
    leads into such a turn (text the model is given before its generation prompt ends: DeepSeek's
    <｜tool▁outputs▁end｜>, counted as "prompt"), or, not touching them, where the text holds assistant turns this
    example does not train (each trained in an example of its own: _check_conversation)."""
    ids, mask, _ = oracle.encoded(n)
    silent = []
    for run in _runs_of(mask):
        outside = [k for k in run if k not in covered]
        if not outside:
            continue
        inside = [k for k in run if k in covered]
        if inside:
            lead = [k for k in outside if k < inside[0]]
            counts["prompt"] += len(lead)
            counts["oracle"] += len(lead)
            silent += [f"{tok.decode([ids[k]])!r} at token {k}: trained by the oracle after the turn"
                       for k in outside if k > inside[0]]
            continue
        others = [j for j, m in enumerate(oracle.msgs[:n]) if m["role"] == "assistant" and j not in ex.turns]
        if not others:  # every assistant turn of this text is trained here: the run is none of them
            silent.append(f"{tok.decode([ids[k] for k in run])!r} at token {run[0]}: trained by the oracle outside "
                          "every turn")
    return silent


def _runs_of(mask: list[int]) -> list[list[int]]:
    """The runs of consecutive positions where mask is set."""
    runs, run = [], []
    for k, m in enumerate(list(mask) + [0]):
        if m:
            run.append(k)
        elif run:
            runs, run = runs + [run], []
    return runs


def _check_conversation(at: str, examples, outs, renderings: tuple, stops: set[int], tok) -> dict:
    """Per conversation: every trained token of every example the row becomes (module docstring)."""
    oracle = renderings[1]
    assistant = [i for i, m in enumerate(oracle.msgs) if m["role"] == "assistant"]
    trained = sorted(i for ex in examples for i in ex.turns)
    assert trained == assistant, f"{at}: assistant turns {assistant}, trained in the examples {trained}"
    counts = dict.fromkeys(TOKEN_COUNTS, 0)
    counts["examples"] = len(examples)
    silent = []
    for ex, out in zip(examples, outs):
        n = ex.turns[-1] + 1 if ex.split else len(oracle.msgs)
        silent += _check_example(at, ex, out, n, renderings, stops, tok, counts)
    assert not silent, f"{at}: {len(silent)} tokens differ from the oracle:\n" + "\n".join(silent)
    return counts


def run_case(name: str, conv: str, tmp_path_factory) -> tuple[str, dict, dict]:
    """(outcome, per-turn counts, per-token counts) of one family and row; an assertion fails on any disagreement."""
    family = FAMILIES[name]
    folder = str(tmp_path_factory.getbasetemp() / "families" / name)
    tok = _tokenizers(family, folder)
    canon = canonical(conv)
    at = f"{name}/{conv}"
    kwargs = template_kwargs(tok["own"], family.kwargs)
    try:
        examples = render_examples(canon, tok["own"], False, family.kwargs, at)
    except DataError as e:
        if "the chat template refused" in str(e):
            with pytest.raises(TEMPLATE_ERRORS):  # the oracle, the same template marked, refuses it too
                msgs_o = template_messages(canon["messages"], tok["oracle"], kwargs, at)
                tok["oracle"].apply_chat_template(msgs_o, tools=canon.get("tools"), tokenize=False, **kwargs)
            return "template refuses", {}, {}
        lost = (_lost(tok["own"], canon["messages"], canon.get("tools"), kwargs, at)
                or _unprompted(Rendering(tok["own"], template_messages(canon["messages"], tok["own"], kwargs, at),
                                         canon.get("tools"), kwargs)))
        assert lost, f"{at}: hftrain refused a conversation its template writes in full and as prompted: {e}"
        return "hftrain refuses: " + _reason(str(e)), {}, {}
    outs = [label(ex, tok["own"]) for ex in examples]
    assert outs == tokenize_examples(canon, tok["trimmed"], False, family.kwargs, at), \
        f"{at}: labels differ with trim_offsets on"
    renderings, stops = _renderings(family, tok, canon, kwargs, at)
    turns = _check_turns(at, canon, examples, outs, renderings[1], stops, tok["own"], kwargs)
    return "trained", turns, _check_conversation(at, examples, outs, renderings, stops, tok["own"])


def _renderings(family, tok: dict, canon: dict, kwargs: dict, at: str) -> tuple[tuple[Rendering, Oracle], set[int]]:
    """((the family's own template's rendering, the oracle's) of a row, the ids its generation config stops at)."""
    def of(which):
        return template_messages(canon["messages"], tok[which], kwargs, at)

    own = Rendering(tok["own"], of("own"), canon.get("tools"), kwargs)
    oracle = Oracle(tok["oracle"], of("oracle"), canon.get("tools"), kwargs)
    return (own, oracle), {tok["own"].convert_tokens_to_ids(t) for t in family.stop or (family.eos,)}


def _unprompted(own: Rendering) -> str | None:
    """The first assistant turn its template writes, as the last message, after the text before it but without any
    of its generation prompt (checked here, not by hftrain: DeepSeek's second tool-calling turn); None when none."""
    for i, m in enumerate(own.msgs):
        if m["role"] != "assistant" or i == 0:
            continue
        base, prompted, turn = own.render(i), own.render(i, add_generation_prompt=True), own.render(i + 1)
        if len(prompted) > len(base) and turn.startswith(base) and _common(prompted, turn) == len(base):
            return f"message {i}: written {turn[len(base):len(base) + 30]!r}, prompted {prompted[len(base):]!r}"
    return None


def _reason(message: str) -> str:
    for key, short in (("writes none", "no reasoning field"), ("the reasoning of", "drops reasoning"),
                       ("the tool call", "drops the tool call"), ("the content of", "drops content"),
                       ("without its generation prompt", "a turn written unprompted")):
        if key in message:
            return short
    return message[:60]


_tok_cache: dict = {}


def _tokenizers(family, folder: str) -> dict:
    if family.name not in _tok_cache:
        _tok_cache[family.name] = {"own": tokenizer_for(family, folder), "oracle": tokenizer_for(family, folder,
                                                                                                  oracle=True),
                                   "trimmed": tokenizer_for(family, folder, trim_offsets=True)}
    return _tok_cache[family.name]


def _token_at(tok, out: dict, text: str, trained: bool, nth: int = -1) -> int:
    """The index of the nth token (from the end when negative) that decodes to `text` and is (not) trained."""
    found = [k for k, (t, lab) in enumerate(zip(out["input_ids"], out["labels"]))
             if tok.decode([t]) == text and (lab != IGNORE_INDEX) == trained]
    return found[nth]


def _set(out: dict, k: int, trained: bool) -> dict:
    labels = list(out["labels"])
    labels[k] = out["input_ids"][k] if trained else IGNORE_INDEX
    return dict(out, labels=labels)


# (family, row, how the labels are spoiled: (tokenizer, an example's labels) -> those labels spoiled, what is said)
SPOILED = [
    ("glm4moe", "multi_turn", lambda tok, out: _set(out, _token_at(tok, out, "<|user|>", True), False),
     "trained by the oracle only"),  # no stop token after a turn (issue 38)
    ("llava_next", "multi_turn", lambda tok, out: _set(out, _token_at(tok, out, "</s>", True, 0) + 1, True),
     "trained by hftrain only"),  # the space after </s> (issue 38)
    ("diffusion_gemma", "tool_call", lambda tok, out: _set(out, _token_at(tok, out, "<|turn>", False), True),
     "trained by hftrain only"),  # the role marker before an answer after tool results (issue 38)
    ("qwen2_5", "single", lambda tok, out: _set(out, _token_at(tok, out, "<|im_start|>", False, 0), True),
     "trained outside the turns"),
    ("qwen2_5", "multi_turn", lambda tok, out: _set(out, _token_at(tok, out, "<|im_end|>", True, 1), False),
     "trained by the oracle only"),  # a stop token in the middle of a conversation
]


@pytest.mark.parametrize("name, conv, spoil, said", SPOILED, ids=[f"{n}-{c}" for n, c, _, _ in SPOILED])
def test_the_check_sees_every_kind_of_difference(name, conv, spoil, said, tmp_path_factory):
    """Negative control: labels that differ from the oracle by one token (the differences issue 38 found, a token
    outside every turn) fail the per-conversation check, naming the token; the labels hftrain gives pass it."""
    family = FAMILIES[name]
    tok = _tokenizers(family, str(tmp_path_factory.getbasetemp() / "families" / name))
    canon, at = canonical(conv), f"{name}/{conv}"
    kwargs = template_kwargs(tok["own"], family.kwargs)
    examples = render_examples(canon, tok["own"], False, family.kwargs, at)
    outs = [label(ex, tok["own"]) for ex in examples]
    renderings, stops = _renderings(family, tok, canon, kwargs, at)
    _check_conversation(at, examples, outs, renderings, stops, tok["own"])
    with pytest.raises(AssertionError, match=said):
        _check_conversation(at, examples, [spoil(tok["own"], outs[0])] + outs[1:], renderings, stops, tok["own"])


def test_a_turn_trained_twice_is_seen(tmp_path_factory):
    """Negative control: an example repeated (a turn trained twice in one row) fails the per-conversation check."""
    family = FAMILIES["qwen3"]
    tok = _tokenizers(family, str(tmp_path_factory.getbasetemp() / "families" / "qwen3"))
    canon, at = canonical("reasoning_multi_turn"), "qwen3/reasoning_multi_turn"
    examples = render_examples(canon, tok["own"], False, family.kwargs, at)
    outs = [label(ex, tok["own"]) for ex in examples]
    renderings, stops = _renderings(family, tok, canon, template_kwargs(tok["own"], family.kwargs), at)
    with pytest.raises(AssertionError, match="trained in the examples"):
        _check_conversation(at, examples + examples[:1], outs + outs[:1], renderings, stops, tok["own"])


RESULTS: dict = {}  # family -> (rows trained, per-turn counts, per-token counts, rows the template refuses)


def _add(totals: dict, counts: dict) -> None:
    for k, v in counts.items():
        totals[k] = totals.get(k, set()) | v if isinstance(v, set) else totals.get(k, 0) + v


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_labels_agree_with_the_oracle(name, tmp_path_factory):
    outcomes, turns, tokens = {}, dict.fromkeys(TURN_COUNTS, 0), dict.fromkeys(TOKEN_COUNTS, 0)
    for conv in ROWS:
        outcome, turn_counts, token_counts = run_case(name, conv, tmp_path_factory)
        outcomes.setdefault(outcome, []).append(conv)
        _add(turns, turn_counts)
        _add(tokens, token_counts)
    trained = outcomes.get("trained", [])
    refusals = "; ".join(f"{o.removeprefix('hftrain refuses: ')}: {', '.join(c)}" for o, c in sorted(outcomes.items())
                         if o.startswith("hftrain refuses"))
    ends = " ".join(f"`{e}`".replace("|", "\\|") for e in sorted(turns.get("ends", ()))) or "-"  # a Markdown cell
    print(f"\n| {name} | {ends} | {len(trained)}/{len(ROWS)} | {turns['turns']} | {turns['exact']} | "
          f"{turns['prompt']} | {turns['after_stop']} | {turns['stop']} | {turns['whole']} | {tokens['trained']} | "
          f"{', '.join(outcomes.get('template refuses', [])) or '-'} | {refusals or '-'} |")
    assert trained, f"{name}: no conversation trained"
    RESULTS[name] = (len(trained), turns, tokens, len(outcomes.get("template refuses", [])))


def test_summary():
    """The figure of docs/templates.md: families x rows, what was trained, and the differences from the oracle."""
    if set(RESULTS) != set(FAMILIES):
        pytest.skip("needs every family's test in this run")
    turns, tokens = dict.fromkeys(TURN_COUNTS, 0), dict.fromkeys(TOKEN_COUNTS, 0)
    for _, t, k, _ in RESULTS.values():
        _add(turns, t)
        _add(tokens, k)
    cases = len(FAMILIES) * len(ROWS)
    trained = sum(n for n, _, _, _ in RESULTS.values())
    refused = sum(r for _, _, _, r in RESULTS.values())
    allowed = tokens["prompt"] + tokens["after_stop"] + tokens["stop"]
    print(f"\n{len(FAMILIES)} families x {len(ROWS)} rows = {cases} cases: {trained} trained, {refused} refused by "
          f"the template itself, {cases - trained - refused} refused by hftrain (the template would lose text, or "
          "writes a turn without its generation prompt). "
          f"Per turn: {turns['turns']} turns, {turns['exact']} equal to the oracle, the others but for "
          f"generation-prompt tokens the oracle trains (in {turns['prompt']}), whitespace it trains after the stop "
          f"token (in {turns['after_stop']}), the stop token it leaves out (in {turns['stop']}). Per conversation: "
          f"{tokens['examples']} examples, {tokens['trained']} tokens trained, {tokens['oracle']} by the oracle, "
          f"{tokens['agree']} by both, {allowed} allowed differences ({tokens['prompt']} generation prompt, "
          f"{tokens['after_stop']} after the stop, {tokens['stop']} stop token), 0 silent differences")
    assert tokens["trained"] - tokens["agree"] == tokens["stop"]  # every token hftrain trains: the oracle's or a stop
    assert tokens["oracle"] - tokens["agree"] == tokens["prompt"] + tokens["after_stop"]
    assert len(FAMILIES) >= 37
