"""Labels under the real chat templates of model families (tests/data/templates/, each naming its model).

The expected labels are computed here without hftrain's turn-by-turn rendering: the whole conversation is rendered
once with apply_chat_template, and each assistant turn's known text (its content or tool call, then the end-of-turn
token) is found by string search right after the template's assistant header; exactly the tokens of those pieces
are labels. The tokenizer is a byte-level BPE trained here, with each family's special tokens added as single ids.
tests/test_template_oracle.py compares the labels with an oracle on 36 families."""

import json
import os
from datetime import datetime

import pytest
import transformers.utils.chat_template_utils as ctu
from tokenizers import processors
from transformers import AutoTokenizer

from hftrain.config import DataSection, DataSource
from hftrain.methods import parse_recipe
from hftrain.constants import IGNORE_INDEX
from hftrain.data import build_datasets, tokenize_example, tokenize_examples
from hftrain.data.templates import FIXED_DATE, eos_problem, template_kwargs
from hftrain.errors import DataError
from hftrain.evaluate import prompt_ids
from hftrain.tiny import train_tokenizer

from .template_families import FAMILIES as FAMILIES_ORACLE
from .template_families import tokenizer_for

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATES = os.path.join(REPO, "tests", "data", "templates")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
SYSTEM = {"role": "system", "content": "Be brief."}
ASK, AGAIN = {"role": "user", "content": "Weather in Paris?"}, {"role": "user", "content": "And tomorrow?"}
TOOL_RESULT = {"role": "tool", "name": "get_weather", "tool_call_id": "call_1", "content": "sunny"}
SUNNY, RAIN = {"role": "assistant", "content": "It is sunny."}, {"role": "assistant", "content": "Rain."}
AGENT = [SYSTEM, ASK, {"role": "assistant", "content": "", "tool_calls": [CALL]}, TOOL_RESULT, SUNNY, AGAIN, RAIN]
PLAIN = [ASK, SUNNY, AGAIN, RAIN]  # for templates without system role or tools
QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CHATML = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
LLAMA = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
         "<|python_tag|>"]
DEEPSEEK = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
# name: (template, special tokens, bos, eos)
FAMILIES = {
    "qwen2_5": ("qwen2_5", CHATML, None, "<|im_end|>"),
    "qwen3": ("qwen3", CHATML, None, "<|im_end|>"),
    "llama3_1": ("llama3_1", LLAMA, "<|begin_of_text|>", "<|eot_id|>"),
    "llama3_2": ("llama3_2", LLAMA, "<|begin_of_text|>", "<|eot_id|>"),
    "gemma": ("gemma", ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>"),
    "mistral": ("mistral", ["<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>"),
    "phi3_5": ("phi3_5", ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"], None,
               "<|endoftext|>"),
    "deepseek_r1": ("deepseek_r1", DEEPSEEK, DEEPSEEK[0], DEEPSEEK[1]),
}
CORPUS = ["Be brief. Weather in Paris? It is sunny. And tomorrow? Rain. get_weather city sunny",
          "I should look it up. The tool says sunny. You are a helpful assistant. system user assistant model"]
_cache: dict = {}


def family(name: str):
    if name not in _cache:
        template, specials, bos, eos = FAMILIES[name]
        tok = train_tokenizer(CORPUS * 20, vocab_size=400)
        tok.add_tokens(specials, special_tokens=True)
        tok.bos_token, tok.eos_token = bos, eos
        with open(os.path.join(TEMPLATES, f"{template}.jinja"), encoding="utf-8") as fh:
            tok.chat_template = fh.read()
        _cache[name] = tok
    return _cache[name]


def expected_labels(tok, msgs, header: str, pieces: list[str], tools=None, **kwargs) -> tuple[list, list]:
    """(input_ids, labels) with exactly the tokens of each piece, found in order right after `header`, trained.
    Every piece must start and end on a token boundary, so 'the tokens of the piece' is exact."""
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False, **kwargs)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    spans, cursor = [], 0
    for piece in pieces:
        at = text.index(header + piece, cursor) + len(header)
        spans.append((at, at + len(piece)))
        cursor = at + len(piece)
    bounds = {a for a, _ in enc["offset_mapping"]} | {b for _, b in enc["offset_mapping"]}
    assert all(s in bounds and e in bounds for s, e in spans), (spans, text)
    labels = [i if any(s <= a and b <= e for s, e in spans) else IGNORE_INDEX
              for i, (a, b) in zip(enc["input_ids"], enc["offset_mapping"])]
    return enc["input_ids"], labels


def check(tok, out, msgs, header, pieces, tools=None, **kwargs):
    ids, labels = expected_labels(tok, msgs, header, pieces, tools, **kwargs)
    assert out["input_ids"] == ids
    assert out["labels"] == labels, (tok.decode([t for t in out["labels"] if t != IGNORE_INDEX]), pieces)
    assert tok.decode([t for t in labels if t != IGNORE_INDEX]) == "".join(pieces)


def shifted(out: dict) -> dict:
    """The same labels one token later (a mask off by one), re-aligned with input_ids."""
    mask = [lab != IGNORE_INDEX for lab in out["labels"]]
    mask = [False] + mask[:-1]
    return {"input_ids": out["input_ids"], "labels": [t if m else IGNORE_INDEX for t, m in zip(out["input_ids"], mask)]}


# family: (conversation, tools, the template's assistant header, what each assistant turn trains, kwargs). A turn is
# trained up to its last stop token: what the template writes after it ("\n") is never generated.
CASES = {
    "qwen2_5": (AGENT, TOOLS, "<|im_start|>assistant\n",
                [QWEN_CALL + "<|im_end|>", "It is sunny.<|im_end|>", "Rain.<|im_end|>"], {}),
    # Reasoning in every turn after the last user query: Qwen3 keeps it there, so those turns are prefix-stable.
    "qwen3": ([SYSTEM, ASK, {"role": "assistant", "content": "<think>\nI should look it up.\n</think>\n\n",
                             "tool_calls": [CALL]},
               TOOL_RESULT,
               {"role": "assistant", "content": "<think>\nThe tool says sunny.\n</think>\n\nIt is sunny."}],
              TOOLS, "<|im_start|>assistant\n",
              ["<think>\nI should look it up.\n</think>\n\n" + QWEN_CALL + "<|im_end|>",
               "<think>\nThe tool says sunny.\n</think>\n\nIt is sunny.<|im_end|>"], {}),
    "llama3_1": (AGENT, TOOLS, "<|start_header_id|>assistant<|end_header_id|>\n\n",
                 ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', "It is sunny.<|eot_id|>",
                  "Rain.<|eot_id|>"], {}),
    "llama3_2": (AGENT, TOOLS, "<|start_header_id|>assistant<|end_header_id|>\n\n",
                 ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', "It is sunny.<|eot_id|>",
                  "Rain.<|eot_id|>"], {"date_string": FIXED_DATE}),
    "gemma": (PLAIN, None, "<start_of_turn>model\n", ["It is sunny.<end_of_turn>", "Rain.<end_of_turn>"], {}),
    "mistral": (PLAIN, None, "[/INST]", ["It is sunny.</s>", "Rain.</s>"], {}),
    # eos_token only after the conversation's last message: trained there, and nowhere else.
    "phi3_5": ([SYSTEM] + PLAIN, None, "<|assistant|>\n",
               ["It is sunny.<|end|>", "Rain.<|end|>\n<|endoftext|>"], {}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_real_templates_train_exactly_the_assistant_turns(name):
    msgs, tools, header, pieces, kwargs = CASES[name]
    tok = family(name)
    out = tokenize_example({"messages": msgs, "tools": tools}, tok, train_on_prompt=False)
    check(tok, out, msgs, header, pieces, tools, **kwargs)
    eot = tok.convert_tokens_to_ids({"gemma": "<end_of_turn>", "phi3_5": "<|end|>"}.get(name, FAMILIES[name][3]))
    assert sum(1 for t in out["labels"] if t == eot) == len(pieces)  # every turn's end-of-turn token is a label
    with pytest.raises(AssertionError):  # negative control: the check sees a mask one token off
        check(tok, shifted(out), msgs, header, pieces, tools, **kwargs)


def test_tool_calls_trained_tool_results_and_tools_block_not():
    tok = family("qwen2_5")
    out = tokenize_example({"messages": AGENT, "tools": TOOLS}, tok, train_on_prompt=False)
    trained = tok.decode([t for t in out["labels"] if t != IGNORE_INDEX])
    assert '"arguments": {"city": "Paris"}' in trained and "sunny" not in trained.replace("It is sunny.", "")
    assert '"description": "Weather of a city"' in tok.decode(out["input_ids"])  # the tools reached the template
    assert "<tool_response>" not in trained and "# Tools" not in trained


def test_qwen3_enable_thinking_reaches_every_rendering():
    tok, msgs = family("qwen3"), [ASK, SUNNY]
    out = tokenize_example({"messages": msgs}, tok, False)
    check(tok, out, msgs, "<|im_start|>assistant\n", ["<think>\n\n</think>\n\nIt is sunny.<|im_end|>"])
    out = tokenize_example({"messages": msgs}, tok, False, {"enable_thinking": False})
    # The empty think block is now the generation prompt's: given to the model, not trained.
    check(tok, out, msgs, "<|im_start|>assistant\n<think>\n\n</think>\n\n", ["It is sunny.<|im_end|>"],
          enable_thinking=False)


THINK_CALL = "<think>\nI should look it up.\n</think>\n\n" + QWEN_CALL + "<|im_end|>"
THINK_SUNNY = "<think>\nThe tool says sunny.\n</think>\n\nIt is sunny.<|im_end|>"


def test_qwen3_turns_the_template_rewrites_are_trained_as_generated():
    """Qwen3 drops the reasoning of turns before the last user query: those turns are trained in an example that
    ends with them (as the model generated them), the last turn in the whole conversation (issue 27 point 1; the
    row was refused before)."""
    tok = family("qwen3")
    msgs = CASES["qwen3"][0] + [AGAIN, RAIN]
    first, last = tokenize_examples({"messages": msgs, "tools": TOOLS}, tok, False)
    check(tok, first, msgs[:5], "<|im_start|>assistant\n", [THINK_CALL, THINK_SUNNY], TOOLS)
    check(tok, last, msgs, "<|im_start|>assistant\n", ["<think>\n\n</think>\n\nRain.<|im_end|>"], TOOLS)
    assert "I should look it up" not in tok.decode(last["input_ids"])  # the history as the model sees it later
    with pytest.raises(ValueError, match="becomes 2 examples"):
        tokenize_example({"messages": msgs, "tools": TOOLS}, tok, False)
    # data.train_turns: last trains the final turn only, in the whole conversation
    assert tokenize_examples({"messages": msgs, "tools": TOOLS}, tok, False, train_turns="last") == [last]
    # reasoning given as reasoning_content (or reasoning, thinking) reaches the template: the same tokens
    split = [dict(m, content=m["content"].split("</think>\n\n")[-1], reasoning_content=m["content"].split(
        "</think>")[0].removeprefix("<think>\n").strip()) if "<think>" in m["content"] else m for m in msgs]
    assert split[2]["reasoning_content"] == "I should look it up." and split[2]["content"] == ""
    assert tokenize_examples({"messages": split, "tools": TOOLS}, tok, False) == [first, last]


def test_a_prefix_stable_template_gives_one_example_per_conversation():
    tok = family("qwen2_5")
    assert len(tokenize_examples({"messages": AGENT, "tools": TOOLS}, tok, False)) == 1


def test_deepseek_r1_trains_from_where_its_generation_prompt_and_turn_part():
    """R1's generation prompt opens <think>, its turns are written without it: the turn is trained from where the
    two part (after <｜Assistant｜>), with the end-of-sentence token (the row was refused before). Its template drops
    the reasoning of every turn: a row with reasoning is refused, naming what would be lost."""
    tok = family("deepseek_r1")
    msgs = [SYSTEM, ASK, SUNNY]
    check(tok, tokenize_example({"messages": msgs}, tok, False), msgs, "<｜Assistant｜>",
          ["It is sunny.<｜end▁of▁sentence｜>"])
    inline = [SYSTEM, ASK, {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\nIt is sunny."}]
    with pytest.raises(DataError, match=r"row 3: the chat template does not write the content of message 2 "
                                        r"\(assistant\): '<think>' is not in the text it trains for that turn"):
        tokenize_example({"messages": inline, "row": 3}, tok, False, source="data.sources.0 (r1.jsonl)")
    field = [SYSTEM, ASK, dict(SUNNY, reasoning_content="Easy.")]
    with pytest.raises(DataError, match=r"row 3: assistant message 2 has reasoning \(reasoning_content\) and the "
                                        r"chat template writes none"):
        tokenize_example({"messages": field, "row": 3}, tok, False, source="data.sources.0 (r1.jsonl)")
    out = tokenize_example({"messages": inline}, tok, True)  # whole-text training: what the template writes
    assert out["labels"] == out["input_ids"]


def test_a_turn_written_without_its_generation_prompt_is_refused():
    """DeepSeek-R1's template writes only the first tool-calling turn of a conversation with its header: a second one
    follows the user's message with no <｜Assistant｜>, so it would be trained on text the model is never prompted
    for (issue 38: hftrain trained it, as the oracle does). The row is refused naming the row, the turn, the prompt
    and the fix; a conversation with one tool-calling turn is trained."""
    tok = family("deepseek_r1")
    call = {"role": "assistant", "content": "", "tool_calls": [dict(CALL, function=dict(
        CALL["function"], arguments='{"city": "Paris"}'))]}
    one = [ASK, call, TOOL_RESULT, SUNNY]
    assert len(tokenize_examples({"messages": one, "tools": TOOLS}, tok, False)) == 1
    with pytest.raises(DataError, match=r"^data.sources.0 \(r1.jsonl\), row 2: the chat template writes assistant "
                                        r"message 5 without its generation prompt: the model is prompted with "
                                        r"'<｜Assistant｜><think>\\n' there, .* Fix: split the row"):
        tokenize_examples({"messages": one + [AGAIN, call, TOOL_RESULT, RAIN], "tools": TOOLS, "row": 2}, tok,
                          False, source="data.sources.0 (r1.jsonl)")


@pytest.mark.parametrize("name, msgs, said, fix", [
    ("gemma", [SYSTEM] + PLAIN, "System role not supported", "merge the system message into the first user turn"),
    ("mistral", [ASK, AGAIN, SUNNY], "Conversation roles must alternate user/assistant", "make the roles alternate"),
    ("mistral", [ASK, TOOL_RESULT, AGAIN, SUNNY],
     "Only user and assistant roles are supported", "fix the row"),
])
def test_template_refusals_name_source_row_message_and_fix(name, msgs, said, fix):
    with pytest.raises(DataError) as e:
        tokenize_example({"messages": msgs, "row": 4}, family(name), False, source="data.sources.1 (chat.jsonl)")
    msg = str(e.value)
    assert msg.startswith("data.sources.1 (chat.jsonl), row 4: the chat template refused the conversation: ")
    assert said in msg and fix in msg


def test_llama3_date_is_pinned_so_ids_do_not_depend_on_the_day(monkeypatch):
    tok = family("llama3_2")

    def on(day):
        class Clock(datetime):
            @classmethod
            def now(cls, tz=None):
                return datetime(2026, 1, day)
        monkeypatch.setattr(ctu, "datetime", Clock)

    on(1)
    first = tokenize_example({"messages": PLAIN}, tok, False)
    raw = tok.apply_chat_template(PLAIN, tokenize=False)
    on(2)
    assert tok.apply_chat_template(PLAIN, tokenize=False) != raw  # control: the template does read the clock
    assert tokenize_example({"messages": PLAIN}, tok, False) == first
    assert f"Today Date: {FIXED_DATE}\n" in tok.decode(first["input_ids"])
    chosen = tokenize_example({"messages": PLAIN}, tok, False, {"date_string": "01 Jan 2025"})
    assert "Today Date: 01 Jan 2025\n" in tok.decode(chosen["input_ids"])
    assert template_kwargs(family("qwen2_5"), {}) == {}  # templates without a date are given nothing


def test_eos_agreement(tmp_path, capsys):
    tok = family("qwen2_5")
    assert eos_problem(tok, {}) is None  # <|im_end|> ends turns and is the eos_token
    base = train_tokenizer(CORPUS * 20, vocab_size=400)  # a base model's tokenizer: eos <|endoftext|>
    base.eos_token, base.chat_template = "<|endoftext|>", tok.chat_template
    problem = eos_problem(base, {})
    assert "ends each assistant turn with '<|im_end|>'" in problem and "eos_token '<|endoftext|>'" in problem
    assert "generation_config.json" in problem
    tokenize_example({"messages": PLAIN}, base, False)
    tokenize_example({"messages": PLAIN}, base, False)
    assert capsys.readouterr().out.count("warning: the chat template ends each assistant turn") == 1
    assert "no generation_config.json found" in problem
    base.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": base.eos_token_id}))
    problem = eos_problem(AutoTokenizer.from_pretrained(tmp_path), {})
    assert f"generation_config.json's eos_token_id {base.eos_token_id}" in problem
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [base.convert_tokens_to_ids("<|im_end|>"), base.eos_token_id]}))
    assert eos_problem(AutoTokenizer.from_pretrained(tmp_path), {}) is None  # the model stops at <|im_end|> too


GEN_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['role'] == 'assistant' %}"
                "{% generation %}{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}"
                "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                "{% endif %}")


@pytest.mark.parametrize("inside", [False, True])
def test_generation_markers_use_transformers_mask_and_train_the_end_of_turn(inside):
    tok = train_tokenizer(CORPUS * 20, vocab_size=400)
    tok.chat_template = (GEN_TEMPLATE.replace("{{ m['content'] }}{% endgeneration %}",
                                              "{{ m['content'] + '<|im_end|>' }}{% endgeneration %}")
                         .replace("{% else %}{{ m['content'] }}{% endif %}{{ '<|im_end|>\\n' }}",
                                  "{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}")
                         if inside else GEN_TEMPLATE)
    out = tokenize_example({"messages": PLAIN}, tok, False)
    check(tok, out, PLAIN, "<|im_start|>assistant\n", ["It is sunny.<|im_end|>", "Rain.<|im_end|>"])


def test_chat_template_kwargs_reach_the_dataset_build(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [ASK, SUNNY]}) + "\n")
    cfg = DataSection(sources=[DataSource(path=str(path))], chat_template_kwargs={"enable_thinking": False})
    row = build_datasets(cfg, family("qwen3")).train[0]
    assert family("qwen3").decode([t for t in row["labels"] if t != IGNORE_INDEX]) == "It is sunny.<|im_end|>"
    cfg = DataSection(sources=[DataSource(path=str(path))], chat_template_kwargs={"tools": []})
    with pytest.raises(DataError, match=r"data.chat_template_kwargs: \['tools'\] are arguments hftrain sets"):
        build_datasets(cfg, family("qwen3"))


def test_exact_match_prompts_are_rendered_with_the_training_kwargs():
    tok = family("qwen3")
    ids = prompt_ids(tok, {"messages": [ASK], "reference": "It is sunny."}, {"enable_thinking": False})
    assert tok.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tok.decode(prompt_ids(tok, {"messages": [ASK]})).endswith("<|im_start|>assistant\n")
    assert f"Today Date: {FIXED_DATE}" in family("llama3_2").decode(prompt_ids(family("llama3_2"), {"messages": [ASK]}))


def test_chat_template_kwargs_is_a_recipe_key():
    recipe, problems = parse_recipe(os.path.join(REPO, "recipes", "demo", "sft.yaml"),
                                    ["data.chat_template_kwargs={enable_thinking: false}"])
    assert problems == [] and recipe.data.chat_template_kwargs == {"enable_thinking": False}
    _, problems = parse_recipe(os.path.join(REPO, "recipes", "demo", "sft.yaml"), ["data.chat_template_kwargs=[1]"])
    assert problems == ["command line: data.chat_template_kwargs: expected a mapping, got [1]"]


def test_a_template_refusal_in_a_source_names_the_source_and_file(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": PLAIN}) + "\n" + json.dumps({"messages": [SYSTEM] + PLAIN}) + "\n")
    with pytest.raises(DataError, match=rf"^data.sources.0 \({path}:2\): the chat template refused the "
                                        "conversation: System role not supported. Fix: merge the system message"):
        build_datasets(DataSection(sources=[DataSource(path=str(path))]), family("gemma"))


def test_the_fine_tuned_model_stops_where_turns_end():
    """The fix for the disagreement: the end-of-turn token joins generation_config.eos_token_id (saved with the
    model); nothing changes when it already stops there."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from hftrain.data.templates import stop_at_end_of_turn

    base = train_tokenizer(CORPUS * 20, vocab_size=400)
    base.eos_token, base.chat_template = "<|endoftext|>", family("qwen2_5").chat_template
    im_end = base.convert_tokens_to_ids("<|im_end|>")
    model = SimpleNamespace(generation_config=GenerationConfig(eos_token_id=base.eos_token_id))
    assert stop_at_end_of_turn(model, base) == [im_end]
    assert model.generation_config.eos_token_id == [base.eos_token_id, im_end]
    assert stop_at_end_of_turn(model, base) == [] and model.generation_config.eos_token_id[-1] == im_end


@pytest.mark.parametrize("trim_offsets", [False, True])
def test_labels_do_not_depend_on_the_offset_convention(trim_offsets):
    """A byte-level post-processor that trims offsets (the tokenizers default) gives a token of spaces zero width;
    its labels must be the same as without trimming (issue 27 point 6: " 2 + 3 = 5." trained as "2 +", "3 =", "5."
    before)."""
    tok = train_tokenizer(["abc def"] * 20, vocab_size=300)  # no merge joins a space to a digit: spaces alone
    backend = tok.backend_tokenizer
    backend.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=trim_offsets),
                                                  backend.post_processor])
    assert "Ġ" in tok.convert_ids_to_tokens(tok(" 2 + 3")["input_ids"])
    out = tokenize_example({"prompt": "Sum:", "completion": " 2 + 3 = 5."}, tok, False)
    assert tok.decode([t for t in out["labels"] if t != IGNORE_INDEX]) == " 2 + 3 = 5.<|im_end|>"
    chat = tokenize_example({"messages": [{"role": "user", "content": "Sum?"},
                                          {"role": "assistant", "content": "2 + 3 = 5."}]}, tok, False)
    assert tok.decode([t for t in chat["labels"] if t != IGNORE_INDEX]) == "2 + 3 = 5.<|im_end|>"


@pytest.mark.parametrize("generation_config", [True, False])
def test_glm_trains_the_next_roles_token_that_ends_its_turn(tmp_path, capsys, generation_config):
    """GLM-4-MoE ends an assistant turn with nothing: the next role's token (<|user|>, <|observation|>) stops
    generation (its generation_config.json eos_token_id). That token is trained after every turn: the one that
    follows the turn, or after the last message the one the template writes after such a turn (issue 27 point 5).
    Without the generation config (a tokenizer saved alone, issue 38) the template says the same: those tokens are
    what it ends a turn with, so they are trained, the run is warned that generation does not stop at them, and
    the fine-tuned model's generation config gets them."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from hftrain.data.templates import stop_at_end_of_turn

    glm = FAMILIES_ORACLE["glm4moe"]
    tok = tokenizer_for(glm, str(tmp_path / "glm"))
    if not generation_config:
        (tmp_path / "glm" / "generation_config.json").unlink()
    agent = [ASK, {"role": "assistant", "content": "", "tool_calls": [CALL]}, TOOL_RESULT, SUNNY, AGAIN, RAIN]
    out = tokenize_example({"messages": agent, "tools": TOOLS}, tok, False)
    assert trained_runs(tok, out) == [
        "\n<think></think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "</tool_call><|observation|>", "\n<think></think>\nIt is sunny.<|user|>", "\n<think></think>\nRain.<|user|>"]
    assert tok.decode(out["input_ids"]).endswith("Rain.<|user|>")  # appended after the last message
    warned = "ends each assistant turn with '<|user|>' / '<|observation|>'" in capsys.readouterr().out
    assert warned != generation_config  # said only when generation does not stop there
    user, observation = tok.convert_tokens_to_ids(["<|user|>", "<|observation|>"])
    model = SimpleNamespace(generation_config=GenerationConfig(eos_token_id=tok.eos_token_id))
    assert stop_at_end_of_turn(model, tok) == [user, observation]
    assert model.generation_config.eos_token_id == [tok.eos_token_id, user, observation]


def trained_runs(tok, out: dict) -> list[str]:
    runs, run = [], []
    for t, lab in zip(out["input_ids"] + [None], out["labels"] + [IGNORE_INDEX]):
        if lab != IGNORE_INDEX:
            run.append(t)
        elif run:
            runs, run = runs + [tok.decode(run)], []
    return runs
