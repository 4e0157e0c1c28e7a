"""Token-exact tool trajectories (issue 41), for every family of the template oracle (tests/template_families.py) whose
template TRL runs tools with: TRL's own tool loop (GRPOTrainer._tool_call_loop, with hftrain's GroupTrainer suffix)
plays a two-turn exchange (a tool call, the tool's answer, the final answer) with generation scripted as the model
would sample it from the family's own template: the tokens of the template's rendering after the generation prompt,
up to and including the first token that stops generation (the model's generation_config).

Checked per family: the loss covers exactly the sampled tokens (mask 1) and never the tool's answer (mask 0); the
context the model continued from after the tool equals the template's rendering of the same exchange, token for token;
and every trained token is one the family's oracle (its template with {% generation %} markers) gives the assistant,
except a stop token the template puts outside the assistant's turn (GLM-4.5's <|observation|>, Gemma 4's
<|tool_response>: the model generates it, and must, to hand over to the tool). Templates TRL's loop cannot append a
tool's answer with are refused before the model loads (tools.tool_template_problem)."""

import os
import tempfile
import types

import pytest
from transformers.utils import get_json_schema

from hftrain.methods.grpo.grpo import GroupTrainer
from hftrain.methods.grpo.user_code import CallCounts, TimeLimit
from hftrain.methods.grpo.tools import guarded, suffix_after_stop, tool_template_problem

from .template_families import FAMILIES, tokenizer_for


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return str(a + b)


TOOLS = [get_json_schema(add)]
TOOL_LIMIT = TimeLimit(5.0, "grpo.tool_timeout")
USER = [{"role": "user", "content": "What is 2 + 3?"}]
CALL = {"role": "assistant", "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}
ANSWER = {"role": "tool", "name": "add", "content": "5"}
FINAL = {"role": "assistant", "content": "The answer is 5."}
# Families whose generation prompt is not how the template renders the same turn in history (the reasoning of
# earlier turns is rewritten): the loop trains what the model saw, and there is no one rendering to compare with.
REWRITES_HISTORY = {"nemotron_3_nano", "nemotron_3_super", "nemotron_3_ultra", "nemotron_3_5_lightning"}
# Refused before the model loads (tools.tool_template_problem): TRL has no parser for their tool calls (it matches
# a template by its text: the Llama 3.1/3.2 templates here are Meta's, not TRL's copies), or its loop cannot append a
# tool's answer (Qwen3's own template drops the turn's empty think block once a tool answers: TRL raises mid-run).
UNPARSED = "is not one whose tool calls TRL can parse"
REFUSED = {"qwen3": "cannot render a tool's answer after a tool call", "qwen3_0_6b": UNPARSED,
           "deepseekv3": UNPARSED, "deepseek_r1": UNPARSED, "diffusion_gemma": UNPARSED, "muse_glimmer": UNPARSED,
           "llama3_1": UNPARSED, "llama3_2": UNPARSED}


def _tool_families() -> list[str]:
    from trl.chat_template_utils import supports_tool_calling

    with tempfile.TemporaryDirectory() as folder:
        return [name for name, family in FAMILIES.items()
                if supports_tool_calling(tokenizer_for(family, os.path.join(folder, name)))]


TOOL_FAMILIES = _tool_families()


def render(tokenizer, messages, generation_prompt=False) -> list[int]:
    return tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=generation_prompt,
                                         tokenize=True, return_dict=False)


def sampled(rendering: list[int], start: int, stops: set[int]) -> list[int]:
    """What the model generates from `start`: the rendering's tokens up to and including the first stop token."""
    for i in range(start, len(rendering)):
        if rendering[i] in stops:
            return rendering[start:i + 1]
    return rendering[start:]


def play(tokenizer, stops: list[int], prompt: list[int], first: list[int], then, rounds: int = 3):
    """TRL's tool loop on GroupTrainer's suffix, with `first` sampled and then(context) the generation after the tool,
    at most `rounds` rounds of calls. Returns (completion ids, tool mask, the ids generation continued from, what was
    generated then, the tool counts)."""
    from trl.chat_template_utils import add_response_schema, parse_response

    tokenizer = add_response_schema(tokenizer)
    counts, seen = CallCounts(), []

    def generate(ids, *args, **kwargs):
        seen.append((ids[0], then(ids[0])))
        return [seen[-1][1]], None

    trainer = GroupTrainer.__new__(GroupTrainer)  # the loop's state alone, without a model to train
    vars(trainer).update(
        processing_class=tokenizer, _tokenizer=tokenizer, chat_template=None, chat_template_kwargs={}, _is_vlm=False,
        eos_token_ids=stops, _sync_tool_dicts=[{"add": guarded(add, TOOL_LIMIT, counts)}], _async_tool_dicts=[{}],
        max_tool_calling_iterations=rounds, tool_counts=counts, use_vllm=False, max_completion_length=4096, tools=[add],
        environment_factories=None, model=types.SimpleNamespace(config=types.SimpleNamespace(
            max_position_embeddings=1 << 20)), _generate_single_turn=generate)
    completions = [[parse_response(tokenizer, first, prefix=prompt, tools=[add])]]
    assert completions[0][0].get("tool_calls"), completions  # TRL parses the sampled call
    mask, _, ids, _, calls, failures, _ = trainer._tool_call_loop(
        [list(USER)], [prompt], [list(first)], completions, None, None, {})
    assert failures == 0 and calls == len(seen)
    return ids[0], mask[0], *seen[0], counts.take()


@pytest.mark.parametrize("name", [n for n in TOOL_FAMILIES if n not in REFUSED])
def test_a_tool_trajectory_trains_exactly_the_sampled_tokens(name, tmp_path):
    family = FAMILIES[name]
    tokenizer = tokenizer_for(family, str(tmp_path))
    assert tool_template_problem(tokenizer) is None
    stops = sorted({tokenizer.convert_tokens_to_ids(t) for t in (family.stop or (family.eos,))}
                   | {tokenizer.eos_token_id})
    prompt, whole = render(tokenizer, USER, True), render(tokenizer, [*USER, CALL, ANSWER, FINAL])
    if name in REWRITES_HISTORY:  # scripted from the turn rendered last (not compared with a rendering)
        first = render(tokenizer, [*USER, CALL])[len(prompt) - 1:]
        first = sampled(first, 0, set(stops)) if set(first) & set(stops) else [*first, stops[0]]

        def then(context):
            return tokenizer.encode("The answer is 5.", add_special_tokens=False) + [stops[0]]
    else:
        assert whole[:len(prompt)] == prompt
        first = sampled(whole, len(prompt), set(stops))

        def then(context):  # the template's continuation of the context the loop built
            return sampled(whole, len(context), set(stops))
    ids, mask, context, second, counts = play(tokenizer, stops, prompt, first, then)
    assert counts["calls"] == 1 and counts["cut"] == 0

    assert [t for t, m in zip(ids, mask) if m] == first + second  # the loss: the sampled tokens, all of them
    answer = ids[len(first):len(ids) - len(second)]
    assert set(mask[len(first):len(ids) - len(second)]) == {0} and "5" in tokenizer.decode(answer)
    assert context == prompt + ids[:len(ids) - len(second)]  # generation went on from what is trained
    if name in REWRITES_HISTORY:
        return
    assert context == whole[:len(context)], (  # what the model continued from is the template's rendering
        tokenizer.decode(context[len(prompt):]), tokenizer.decode(whole[len(prompt):len(context) + 2]))
    assert prompt + ids == whole[:len(prompt) + len(ids)] and "The answer is 5." in tokenizer.decode(second)
    oracle = tokenizer_for(family, str(tmp_path), oracle=True).apply_chat_template(
        [*USER, CALL, ANSWER, FINAL], tools=TOOLS, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert oracle["input_ids"][:len(prompt) + len(ids)] == prompt + ids
    marked = oracle["assistant_masks"][len(prompt):len(prompt) + len(ids)]
    outside = [tokenizer.convert_ids_to_tokens(t) for t, m, o in zip(ids, mask, marked) if m and not o]
    assert all(t in {tokenizer.convert_ids_to_tokens(s) for s in stops} for t in outside), outside


@pytest.mark.parametrize("rounds, cut", [(1, 1), (2, 0)])
def test_a_rollout_left_on_a_call_past_the_limit_is_counted(rounds, cut, tmp_path):
    """Qwen2.5: the model calls the tool, then calls it again. With grpo.max_tool_calls 1 TRL's loop stops on the
    second call, which never runs: one cut rollout (tools/cut_rollouts); with 2 the second call runs (the scripted
    model then answers) and nothing is cut."""
    tokenizer = tokenizer_for(FAMILIES["qwen2_5"], str(tmp_path))
    stops = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    prompt, whole = render(tokenizer, USER, True), render(tokenizer, [*USER, CALL, ANSWER, FINAL])
    first = sampled(whole, len(prompt), set(stops))
    answers = [first, tokenizer.encode("5", add_special_tokens=False) + stops]  # a second call, then an answer
    *_, counts = play(tokenizer, stops, prompt, first, lambda context: answers.pop(0), rounds=rounds)
    assert counts["cut"] == cut and counts["calls"] == rounds


def test_the_suffix_drops_only_a_stop_token_the_model_generated():
    assert suffix_after_stop([7, 1, 2], [7, 9], 7) == [1, 2] and suffix_after_stop([1, 7], [7], 7) == [1, 7]
    assert suffix_after_stop([7, 1, 2], [7, 9], 9) == [7, 1, 2]  # another stop token ended the turn
    assert suffix_after_stop([7, 1, 2], [9], 7) == [7, 1, 2] and suffix_after_stop([], [7], 7) == []


def test_a_call_ended_by_another_stop_token_keeps_the_tools_first_token(tmp_path):
    """GLM-4.5 stops at <|user|> and at <|observation|>, and its tool part begins with <|observation|>. A call the
    model ended with <|user|> never wrote <|observation|>: the context after the tool holds it (masked out), once;
    a call ended with <|observation|> has it once too, the model's own (trained)."""
    tokenizer = tokenizer_for(FAMILIES["glm4moe"], str(tmp_path))
    user, observation = tokenizer.convert_tokens_to_ids(["<|user|>", "<|observation|>"])
    stops = sorted({user, observation, tokenizer.eos_token_id})
    prompt, whole = render(tokenizer, USER, True), render(tokenizer, [*USER, CALL, ANSWER, FINAL])
    sampled_call = sampled(whole, len(prompt), set(stops))
    assert sampled_call[-1] == observation
    final = tokenizer.encode("The answer is 5.", add_special_tokens=False) + [user]
    for last in (user, observation):
        first = sampled_call[:-1] + [last]
        ids, mask, context, _, _ = play(tokenizer, stops, prompt, first, lambda context: list(final))
        assert context[len(prompt):].count(observation) == 1, tokenizer.decode(context[len(prompt):])
        assert (ids[len(first)] == observation) == (last == user)  # the template's, after <|user|> only
        assert mask[:len(first)] == [1] * len(first) and mask[len(first)] == 0


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_template_trls_loop_cannot_append_a_tool_answer_with_is_refused(name, tmp_path):
    family = FAMILIES[name]
    problem = tool_template_problem(tokenizer_for(family, str(tmp_path)))
    assert problem is not None and problem.startswith(REFUSED[name]), problem


def test_every_tool_family_of_the_oracle_is_covered():
    assert {"glm4moe", "gptoss", "qwen2_5", "qwen3_8", "lfm2_v2", "nemotron_3_nano"} <= set(TOOL_FAMILIES)
    assert REFUSED.keys() <= set(TOOL_FAMILIES) and REWRITES_HISTORY <= set(TOOL_FAMILIES)
