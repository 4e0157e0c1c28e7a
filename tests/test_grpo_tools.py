"""GRPO's tools (grpo.tools, methods/grpo/tools.py), fast: a tool that raises, hangs, exits or returns no text gives the
model an error line and a count, never a stuck rank or a stopped run; the schema transformers builds survives the
guard; tools without a schema and templates TRL cannot parse tool calls from are refused before the model loads."""

import json
import re
import time

import pytest
import torch

from hftrain.methods import GrpoSection, RewardSpec, parse_recipe
from hftrain.errors import RewardError
from hftrain.methods.grpo.user_code import CallCounts, TimeLimit
from hftrain.methods.grpo.environments import shown_tools
from hftrain.methods.grpo.tools import guarded, load_tools, tool_template_problem

BASE = {"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d.jsonl"}]},
        "grpo": {"rewards": [{"function": "exact_match"}]}}


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return str(a + b)


def test_a_tool_that_fails_in_any_way_answers_with_an_error_and_is_counted(capsys):
    counts = CallCounts()

    def broken(x: int) -> str:
        """Divide by x. Args: x: the divisor."""
        return str(1 / x)

    def slow(x: int) -> str:
        """Sleep. Args: x: seconds."""
        time.sleep(x)
        return "late"

    def number(x: int) -> str:
        """A number, not text. Args: x: any."""
        return x

    def leaving(x: int) -> str:
        """Exit. Args: x: the status."""
        print("bye")
        raise SystemExit(x)

    def editing(xs: list) -> str:
        """Edit the list it gets. Args: xs: a list."""
        xs.append(1)
        return str(len(xs))

    limit = TimeLimit(0.5, "grpo.tool_timeout")
    tools = {f.__name__: guarded(f, limit, counts) for f in (add, broken, slow, number, leaving, editing)}
    assert tools["add"](a=2, b=3) == "5"
    assert tools["broken"](x=0) == "error: broken raised ZeroDivisionError: division by zero"
    start = time.monotonic()
    assert tools["slow"](x=60) == "error: slow did not return within grpo.tool_timeout=0.5 s"
    # interrupted: far below the 60 s the call takes by itself, whatever the machine's load
    assert time.monotonic() - start < 30
    assert tools["number"](x=7) == "error: number returned int, not text"
    assert tools["leaving"](x=3) == "error: leaving called sys.exit(3)"
    assert "bye" in capsys.readouterr().err  # a tool's prints stay off stdout
    mine = [0]
    assert tools["editing"](xs=mine) == "2" and mine == [0]  # it edited a copy
    assert counts.take() == {"calls": 6, "errors": 4, "timeouts": 1, "crashes": 0, "cut": 0}
    assert counts.take() == {"calls": 0, "errors": 0, "timeouts": 0, "crashes": 0, "cut": 0}


def test_the_guard_keeps_the_schema_transformers_shows_the_model():
    from transformers.utils import get_json_schema

    tool = guarded(add, TimeLimit(1.0, "grpo.tool_timeout"), CallCounts())
    assert tool.__name__ == "add" and get_json_schema(tool) == get_json_schema(add)
    assert get_json_schema(tool)["function"]["parameters"]["properties"]["a"]["type"] == "integer"


def test_tools_are_imported_and_a_tool_without_a_schema_is_refused_naming_it(tmp_path, monkeypatch):
    (tmp_path / "my_tools.py").write_text(
        'def add(a: int, b: int) -> str:\n    """Add.\n\n    Args:\n        a: One.\n        b: Two.\n    """\n'
        '    return str(a + b)\n\n\ndef bare(a, b):\n    return a\n')
    monkeypatch.chdir(tmp_path)
    g = GrpoSection(rewards=[RewardSpec(function="exact_match")], tools=["my_tools:add"])
    (tool,) = load_tools(g)
    assert tool(a=1, b=2) == "3"
    with pytest.raises(RewardError, match=r"grpo\.tools\.1: my_tools:bare: transformers cannot build its JSON schema"):
        load_tools(GrpoSection(rewards=g.rewards, tools=["my_tools:add", "my_tools:bare"]))
    with pytest.raises(RewardError, match=r"grpo\.tools\.0: my_tools has no function 'nope'"):
        load_tools(GrpoSection(rewards=g.rewards, tools=["my_tools:nope"]))


def test_two_tools_of_one_name_are_refused_naming_both(tmp_path, monkeypatch):
    """The model calls a tool by its name: of two tools named alike (a tool twice, or a tool and an environment's
    method) the model sees two schemas and one could never be called."""
    add = 'def add(a: int, b: int) -> str:\n    """Add.\n\n    Args:\n        a: One.\n        b: Two.\n    """\n' \
          '    return str(a + b)\n'
    (tmp_path / "dup_a_tools.py").write_text(add)
    (tmp_path / "dup_b_tools.py").write_text(add)
    method = "\n".join("    " + line for line in add.splitlines()).replace("(a: int", "(self, a: int")
    (tmp_path / "adder_envs.py").write_text(f"class Adder:\n    def reset(self, **row):\n        return None\n\n"
                                            f"{method}\n")
    monkeypatch.chdir(tmp_path)
    rewards = [RewardSpec(function="exact_match")]
    with pytest.raises(RewardError, match=r"grpo\.tools\.1: dup_b_tools:add is named 'add', as grpo\.tools\.0 is"):
        load_tools(GrpoSection(rewards=rewards, tools=["dup_a_tools:add", "dup_b_tools:add"]))
    with pytest.raises(RewardError, match=r"grpo\.tools\.0: dup_a_tools:add is named 'add', as a method of "
                                          r"grpo\.environment adder_envs:Adder is"):
        shown_tools(GrpoSection(rewards=rewards, tools=["dup_a_tools:add"], environment="adder_envs:Adder"))
    assert [t.__name__ for t in shown_tools(GrpoSection(rewards=rewards, environment="adder_envs:Adder"))] == ["add"]


def test_only_a_template_whose_tool_calls_trl_parses_runs_tools(tiny_model_dir):
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template, qwen3_chat_template

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tool_template_problem(tokenizer).startswith("is not one whose tool calls TRL can parse")  # hftrain's tiny
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert "cannot render a tool-calling conversation" in tool_template_problem(tokenizer)  # drops tool_calls
    tokenizer.chat_template = qwen3_chat_template  # parsed, but drops a turn's think block once a tool answers
    assert tool_template_problem(tokenizer).startswith("cannot render a tool's answer after a tool call")
    tokenizer.chat_template = qwen2_5_chat_template
    assert tool_template_problem(tokenizer) is None
    assert getattr(tokenizer, "response_template", None) is None  # the check changed a copy, not the run's tokenizer


@pytest.mark.parametrize("override, expected", [
    ("grpo.max_tool_calls=0", "grpo.max_tool_calls: must be at least 1"),
    ("grpo.tool_timeout=-1", "grpo.tool_timeout: must be a finite number of seconds >= 0"),
    ("grpo.tools=[calculator]", "grpo.tools.0: 'calculator' is not module:function"),
])
def test_tool_keys_are_checked(override, expected):
    tree = json.loads(json.dumps(BASE))
    tree["grpo"]["tools"] = ["dup_a_tools:add"]
    found = parse_recipe(None, [override], raw=tree)[1]
    assert any(expected in p for p in found), found


def test_a_tool_limit_without_tools_is_refused():
    found = parse_recipe(None, ["grpo.max_tool_calls=3"], raw=json.loads(json.dumps(BASE)))[1]
    assert any("grpo.max_tool_calls: limits tool calls, and neither grpo.tools nor grpo.environment" in p
               for p in found), found


def test_rewards_read_a_tool_rollouts_final_answer_and_the_tokens_the_model_generated(monkeypatch):
    """A tool rollout's completion is the assistant's turns with the tool's answers between them: exact_match reads
    the final turn (the tool's "5" is not the model's answer), and the rewards' completion_ids hold only the tokens
    the model generated (a length penalty would otherwise charge it for what the tool said)."""
    import types

    from trl import GRPOTrainer

    from hftrain.methods.grpo.grpo import GroupTrainer
    from hftrain.methods.grpo.rewards import exact_match, text_of

    rollout = [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "add"}}]},
               {"role": "tool", "name": "add", "content": "5"}, {"role": "assistant", "content": "five"}]
    assert text_of(rollout) == "five" and text_of([{"role": "assistant", "content": "x"}]) == "x"
    assert exact_match(None, [rollout, rollout[:2]], ["five", "5"]) == [1.0, 0.0]
    seen = []
    monkeypatch.setattr(GRPOTrainer, "_calculate_rewards", lambda self, inputs, p, c, ids: seen.append(ids) or [])
    trainer = GroupTrainer.__new__(GroupTrainer)
    vars(trainer).update(reward_funcs=[], args=types.SimpleNamespace(world_size=1), _tool_mask=[[1, 1, 0, 0, 1], [1]])
    trainer._calculate_rewards([], [], [], [[1, 2, 3, 4, 5], [6]])
    trainer._calculate_rewards([], [], [], [[1, 2, 3]])  # the mask is one generation's: not reused
    assert seen == [[[1, 2, 5], [6]], [[1, 2, 3]]]


def test_the_tools_schemas_count_in_the_prompt_and_show_in_the_preview(tmp_path, tiny_model_dir):
    """TRL renders every prompt with the tools' schemas (a system block of a few hundred tokens for one tool in
    Qwen2.5's template): measured without them, a prompt passed the data.max_length check and ran past it."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    from hftrain.config import DataSection, DataSource
    from hftrain.errors import DataError
    from hftrain.methods.grpo.prompts import preview_prompts, read_prompts

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = qwen2_5_chat_template
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "2 + 3?"},
                                             {"role": "assistant", "content": "5"}]}) + "\n")
    src = DataSource(path=str(path))
    cfg = DataSection(sources=[src], max_length=96)
    (_, _, bare), = read_prompts(src, "data.sources.0", tokenizer, cfg, 16)
    assert bare <= 96 - 16
    with pytest.raises(DataError, match=r"the prompt is \d+ tokens with the tools' schemas and data.max_length 96"):
        read_prompts(src, "data.sources.0", tokenizer, cfg, 16, tools=[add])
    wide = DataSection(sources=[src], max_length=1024)
    (_, _, with_tools), = read_prompts(src, "data.sources.0", tokenizer, wide, 16, tools=[add])
    assert with_tools > bare + 50
    shown = preview_prompts(wide, tokenizer, 16, 1, tools=[add])
    assert '"name": "add"' in shown and f"{with_tools} prompt tokens" in shown
    rollout = shown.split("a tool rollout as it is trained")[1]  # the call and the final answer trained, not the tool's
    call = r'\[\[<tool_call>\n\{"name": "add", "arguments": \{"a": 1, "b": 1\}\}\n</tool_call><\|im_end\|>\]\]'
    assert re.search(call + r'\n<\|im_start\|>user\n<tool_response>\n<answer>\n</tool_response>', rollout), rollout
    assert rollout.rstrip().endswith("[[<final answer><|im_end|>]]"), rollout


class ScriptedModel(torch.nn.Module):
    """A stand-in whose generate() continues each prompt with the next ids of `script` (the same last one after)."""

    def __init__(self, script: list[list[int]]):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.script, self.prompts = list(script), []

    def generate(self, input_ids, **settings):
        self.prompts.append(input_ids[0].tolist())
        new = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        return torch.cat([input_ids, torch.tensor([new])], dim=1)


def test_held_out_answers_of_a_tool_recipe_call_the_tools(tiny_model_dir):
    """eval.exact_match of a GRPO recipe with grpo.tools: the model's call is run and answered as in training, and
    the answer is its last turn (measured without the tools, its answer was the call itself: exact match 0)."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    from hftrain.evaluate import exact_match, greedy_answer
    from hftrain.methods.grpo.tools import ToolAnswer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = qwen2_5_chat_template
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    call = tokenizer.encode('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
                            add_special_tokens=False) + [end]
    final = tokenizer.encode("5", add_special_tokens=False) + [end]
    examples = [{"messages": [{"role": "user", "content": "2 + 3?"}], "reference": "5"}]
    counts = CallCounts()
    model = ScriptedModel([call, final])
    tools = [guarded(add, TimeLimit(5.0, "grpo.tool_timeout"), counts)]
    assert exact_match(model, tokenizer, examples, answer=ToolAnswer(tools, 2)) == 1.0
    first, second = model.prompts
    assert second[:len(first)] == first and second[len(first):len(first) + len(call)] == call
    assert tokenizer.decode(second[len(first) + len(call):]) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert '"name": "add"' in tokenizer.decode(first) and counts.take()["calls"] == 1
    assert exact_match(ScriptedModel([call, final]), tokenizer, examples, answer=greedy_answer) == 0.0
    lockstep = ScriptedModel([call, final])  # every rank generates rounds + 1 times, whatever its turns
    assert ToolAnswer([add], 3)(lockstep, tokenizer, examples[0], 32, synced=True) == "5"
    assert len(lockstep.prompts) == 4


def test_a_template_trl_ships_is_named_trl_name(tiny_model_dir):
    from trl.chat_template_utils import qwen2_5_chat_template

    from hftrain.config import ModelSection
    from hftrain.modeling import load_tokenizer, path_problems

    tokenizer = load_tokenizer(ModelSection(name_or_path=tiny_model_dir), "trl:qwen2_5")
    assert tokenizer.chat_template == qwen2_5_chat_template and tool_template_problem(tokenizer) is None
    problems = dict(path_problems(ModelSection(name_or_path=tiny_model_dir), "trl:qwen9"))
    assert "TRL ships no template 'trl:qwen9' (trl:NAME, NAME one of: " in problems["data.chat_template"]
    assert "qwen2_5, qwen2_5_training" in problems["data.chat_template"]


def test_the_tool_demos_shipped_data_is_its_generators_and_shows_the_tools_own_schema(tmp_path):
    """recipes/demo/make_tool_data.py writes the shipped data/demo/tools_*.jsonl byte for byte; the demonstrations
    show the schema GRPO's chat template will show (transformers' schema of recipes/demo/calculator.py's add, which the
    recipe names), and the tool answers them."""
    import importlib.util
    import os

    from transformers.utils import get_json_schema

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("make_tool_data",
                                                  os.path.join(repo, "recipes", "demo", "make_tool_data.py"))
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    generator.main(out_dir=str(tmp_path))
    for split in ("sft", "train", "eval"):
        shipped = os.path.join(repo, "data", "demo", f"tools_{split}.jsonl")
        assert open(tmp_path / f"tools_{split}.jsonl").read() == open(shipped).read(), split
    (add,) = load_tools(GrpoSection(rewards=[RewardSpec(function="exact_match")],
                                    tools=[os.path.join(repo, "recipes/demo/calculator.py:add")]))
    rows = [json.loads(line) for line in open(tmp_path / "tools_sft.jsonl")]
    assert all(row["tools"] == [get_json_schema(add)] for row in rows)
    for row in rows[:50]:
        call, answer = row["messages"][1]["tool_calls"][0]["function"], row["messages"][2]["content"]
        assert add(**call["arguments"]) == answer == row["messages"][3]["content"]
    held_out = {row["messages"][0]["content"] for row in map(json.loads, open(tmp_path / "tools_eval.jsonl"))}
    assert not held_out & {row["messages"][0]["content"] for row in rows}


def test_the_tool_demos_noisy_rows_are_its_generators_three_in_five_unaided(tmp_path):
    """recipes/demo/make_tool_noisy.py remakes data/demo/tools_noisy.jsonl from the shipped demonstrations byte for
    byte: rows 0, 1 and 2 of every 5 answer at once (the question and the sum, the tools still offered), the others
    are the demonstrations unchanged."""
    import os
    import runpy
    import shutil

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shutil.copy(os.path.join(repo, "data", "demo", "tools_sft.jsonl"), tmp_path / "tools_sft.jsonl")
    runpy.run_path(os.path.join(repo, "recipes", "demo", "make_tool_noisy.py"))["main"](str(tmp_path))
    made = open(tmp_path / "tools_noisy.jsonl").read()
    assert made == open(os.path.join(repo, "data", "demo", "tools_noisy.jsonl")).read()
    demos = [json.loads(line) for line in open(tmp_path / "tools_sft.jsonl")]
    for k, (row, demo) in enumerate(zip(map(json.loads, made.splitlines()), demos)):
        if k % 5 < 3:
            question, *_, answer = demo["messages"]
            assert row == {"messages": [question, answer], "tools": demo["tools"]}
        else:
            assert row == demo
