"""`hftrain export` (hftrain/serving/, cli/export_command.py): GGUF files through llama.cpp's own converter (fetched by
scripts/fetch_llama_cpp_converter.sh), each loaded back by transformers' GGUF loader and compared with the model it
was written from; an adapter run merged into plain safetensors after the fact; the converter's refusals said."""

import json
import os
import shutil

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from hftrain.cli import main
from hftrain.evaluate import greedy_answer, prompt_ids

from .conftest import DEMO_EVAL, DEMO_TRAIN, REPO
from .support import scrambled

pytest.importorskip("gguf")
CONVERTER = os.environ.get("HFTRAIN_LLAMA_CPP", os.path.join(REPO, ".venv", "llama.cpp-converter"))
PROMPTS = 6
MAX_NEW_TOKENS = 6
# The largest logit difference of each type against the float32 model it was written from (the tiny model drawn at
# scale 0.12 with seed 1, the demo's first 6 held-out prompts; avx512 and avx2 alike): f32 bit-equal (the same float32
# weights); f16 2.26e-3 and q8_0 6.69e-2 measured, bounds 10x above, rounded up. A random model's top logits lie
# close, so rounding may change a greedy answer (q8_0: 39/40 the same over 40 prompts; at scale 0.5, half): answers
# are asserted equal for f32 here, and measured for every type on the trained demo model (docs/export.md: 200/200).
LOGIT_BOUNDS = {"f32": 0.0, "f16": 5e-2, "q8_0": 1.0}
SCALE, SEED = 0.12, 1


@pytest.fixture(scope="module")
def converter():
    if not os.path.isfile(os.path.join(CONVERTER, "convert_hf_to_gguf.py")):
        pytest.fail(f"llama.cpp's converter is not in {CONVERTER}: run `bash scripts/fetch_llama_cpp_converter.sh` "
                    "(scripts/setup.sh does)", pytrace=False)
    return CONVERTER


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return scrambled(tiny_model_dir, str(tmp_path_factory.mktemp("scrambled")), seed=SEED, scale=SCALE)


def exported(argv, capsys) -> tuple[int, str]:
    code = main(["export", *argv])
    out = capsys.readouterr()
    return code, out.out + out.err


def refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        main(["export", *argv])
    assert stop.value.code == 2
    out = capsys.readouterr()
    return out.out + out.err


def examples() -> list[dict]:
    with open(DEMO_EVAL, encoding="utf-8") as f:
        return [{"messages": json.loads(line)["messages"][:1]} for line in f][:PROMPTS]


def test_gguf_files_load_back_with_the_trained_models_logits_and_answers(model_dir, converter, tmp_path, capsys):
    out = tmp_path / "gguf"
    code, said = exported([model_dir, "--gguf", "f32,f16,q8_0", "--converter", converter, "--pre-tokenizer", "gpt-2",
                           "--output", str(out), "--check-rows", DEMO_EVAL, "--check-prompts", str(PROMPTS),
                           "--max-new-tokens", str(MAX_NEW_TOKENS)], capsys)
    assert code == 0, said
    name = os.path.basename(model_dir)
    assert sorted(os.listdir(out)) == [f"{name}-{t}.gguf" for t in ("f16", "f32", "q8_0")]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trained = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    answers = [greedy_answer(trained, tokenizer, e, MAX_NEW_TOKENS) for e in examples()]
    assert len(set(answers)) > 1, "the model must answer the prompts differently"
    for gguf_type, bound in LOGIT_BOUNDS.items():
        file = f"{name}-{gguf_type}.gguf"
        written = AutoModelForCausalLM.from_pretrained(str(out), gguf_file=file, dtype=torch.float32).eval()
        written.generation_config = trained.generation_config
        with torch.no_grad():
            largest = max((written(ids).logits - trained(ids).logits).abs().max().item()
                          for ids in (torch.tensor([prompt_ids(tokenizer, e)]) for e in examples()))
        assert largest <= bound, (gguf_type, largest)
        said_answers = [greedy_answer(written, tokenizer, e, MAX_NEW_TOKENS) for e in examples()]
        same = sum(a == b for a, b in zip(said_answers, answers))
        assert same == PROMPTS or gguf_type != "f32", said_answers
        carried = AutoTokenizer.from_pretrained(str(out), gguf_file=file)  # the tokenizer llama.cpp reads
        assert [prompt_ids(carried, e) for e in examples()] == [prompt_ids(tokenizer, e) for e in examples()]
        assert f"| {gguf_type} | {out / file} |" in said
        assert f"| {largest:.3g} | {same}/{PROMPTS} | {PROMPTS}/{PROMPTS} |" in said  # the command's own figures


def test_an_adapter_run_is_merged_into_safetensors_after_the_fact(model_dir, tmp_path, capsys):
    from peft import LoraConfig, PeftModel, get_peft_model

    run = tmp_path / "run"
    torch.manual_seed(0)
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                          LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    lora.save_pretrained(run)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(run)
    recipe = {"model": {"name_or_path": model_dir, "dtype": "float32",
                        "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}},
              "data": {"sources": [{"path": DEMO_TRAIN}]}, "training": {"output_dir": str(run)}}
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    code, said = exported([str(run), "--merged"], capsys)
    assert code == 0, said
    assert f"hftrain: {run}: base + adapter merged into {run / 'merged'}" in said
    merged = AutoModelForCausalLM.from_pretrained(run / "merged", dtype=torch.float32).eval()
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                        run).eval()
    ids = torch.tensor([prompt_ids(AutoTokenizer.from_pretrained(run), examples()[0])])
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        # Merged against base + adapter: 1.31e-6 measured (avx512 and avx2), bound 10x above; the base alone: 2.9.
        assert (merged(ids).logits - adapter(ids).logits).abs().max().item() <= 2e-5
        assert (merged(ids).logits - base(ids).logits).abs().max().item() > 2e-4
    # A second export takes the merged folder the first wrote.
    code, said = exported([str(run), "--merged"], capsys)
    assert code == 0 and f"hftrain: full weights in {run / 'merged'}" in said


def test_what_the_converter_cannot_write_is_said(model_dir, converter, tmp_path, capsys):
    said = refused([model_dir, "--gguf", "f16", "--converter", converter, "--output", str(tmp_path)], capsys)
    assert "does not recognise this tokenizer's pre-tokenizer" in said and "--pre-tokenizer NAME" in said
    other = tmp_path / "other"
    shutil.copytree(model_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchForCausalLM"]}))
    said = refused([str(other), "--gguf", "f16", "--converter", converter], capsys)
    assert "llama.cpp's converter does not write NoSuchForCausalLM (it writes " in said and "LlamaForCausalLM" in said
    assert "--gguf q4_k: one or more of f32, f16, bf16, q8_0" in refused([model_dir, "--gguf", "q4_k"], capsys)
    said = refused([model_dir, "--gguf", "f16", "--converter", str(tmp_path)], capsys)
    assert f"{tmp_path}: no convert_hf_to_gguf.py there" in said
    assert "say what to export: --merged" in refused([model_dir], capsys)
