"""Bad input, refused clearly: each row runs recipes/sft.py's main() in this process (as `python recipes/sft.py`
does, through exit_on_user_error) and asserts exit status 2, one message naming the file/line/key and the fix,
and that nothing was left half-written in output_dir. The cases fail before training starts, most before the
model is loaded, so the whole table runs in seconds."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
import yaml

from hftrain.errors import DataError, exit_on_user_error

from .conftest import DEMO_TRAIN, REPO

_spec = importlib.util.spec_from_file_location("hftrain_sft_script", os.path.join(REPO, "recipes", "sft.py"))
sft = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sft)


@dataclass
class W:
    """Workspace of one case: writes recipes and data files under tmp_path."""

    tmp: str
    model: str
    env: dict = field(default_factory=dict)

    @property
    def out(self) -> str:
        return os.path.join(self.tmp, "out")

    def tree(self) -> dict:
        return {"model": {"name_or_path": self.model, "dtype": "float32"},
                "data": {"sources": [{"path": DEMO_TRAIN}], "max_length": 32},
                "training": {"output_dir": self.out, "max_steps": 1, "per_device_train_batch_size": 2,
                             "report_to": "none", "disable_tqdm": True}}

    def recipe(self, edit=None, text: str | None = None, name="recipe.yaml") -> str:
        p = os.path.join(self.tmp, name)
        if text is None:
            t = self.tree()
            if edit:
                edit(t)
            text = yaml.safe_dump(t, sort_keys=False)
        with open(p, "w", encoding="utf-8") as fh:
            fh.write(text)
        return p

    def file(self, name: str, content: str | bytes) -> str:
        p = os.path.join(self.tmp, name)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as fh:
            fh.write(content.encode() if isinstance(content, str) else content)
        return p

    def data(self, name: str, content: str | bytes, **source) -> str:
        """A recipe training on one data file with this content."""
        path = self.file(name, content)
        return self.recipe(lambda t: t["data"].update(sources=[{"path": path, **source}]))

    def pickled_model(self) -> str:
        d = os.path.join(self.tmp, "pickled")
        shutil.copytree(self.model, d)
        os.remove(os.path.join(d, "model.safetensors"))
        self.file("pickled/pytorch_model.bin", b"not loaded")
        return d

    def broken_model(self, name: str, content: bytes | None = None, cut: int | None = None) -> str:
        """A copy of the model whose file `name` is replaced by `content` or cut to `cut` bytes."""
        d = os.path.join(self.tmp, "broken")
        shutil.copytree(self.model, d)
        p = os.path.join(d, name)
        data = content if content is not None else open(p, "rb").read()[:cut]
        with open(p, "wb") as fh:
            fh.write(data)
        return d

    def checkpoint(self, corrupt=None) -> str:
        """A real checkpoint-1 in output_dir (from the shared one-step run), optionally damaged."""
        ck = os.path.join(self.out, "checkpoint-1")
        shutil.copytree(W.shared_checkpoint, ck)
        if corrupt:
            corrupt(ck)
        return ck


def set_(path: str, value):
    def edit(t):
        node = t
        *parents, last = path.split(".")
        for p in parents:
            node = node.setdefault(p, {}) if not p.isdigit() else node[int(p)]
        node[last] = value
    return edit


def drop(path: str):
    def edit(t):
        *parents, last = path.split(".")
        node = t
        for p in parents:
            node = node[p]
        del node[last]
    return edit


def both(*edits):
    def edit(t):
        for e in edits:
            e(t)
    return edit


def mesh(save_only_model: bool | None = None, **strategy):
    """A device mesh's strategy options (and training.save_only_model, which tensor parallelism needs)."""
    def edit(t):
        t["strategy"] = dict(strategy)
        if save_only_model is not None:
            t["training"]["save_only_model"] = save_only_model
    return edit


def fsdp_mesh(w: "W", **options) -> list[str]:
    """A recipe with an FSDP mesh, run as accelerate's FSDP launcher would (the launcher's strategy agrees)."""
    w.env.update(ACCELERATE_USE_FSDP="true")
    return [w.recipe(mesh(name="fsdp", **options))]


MSG = {"role": "user", "content": "reverse: a b"}
ANS = {"role": "assistant", "content": "b a"}
GOOD_LINE = json.dumps({"messages": [MSG, ANS]})


def truncate_weights(ck):
    p = os.path.join(ck, "model.safetensors")
    os.truncate(p, os.path.getsize(p) - 100)


def unverified(*damage):
    """Damage a checkpoint and remove its manifest (as the plain Trainer or an older hftrain leaves one)."""
    def apply(ck):
        os.remove(os.path.join(ck, "hftrain_manifest.json"))
        for d in damage:
            d(ck)
    return apply


def flip_byte(name: str, at: int = -5):
    def apply(ck):
        with open(os.path.join(ck, name), "r+b") as fh:
            fh.seek(at, os.SEEK_END)
            b = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([b[0] ^ 0xFF]))
    return apply


def write(name: str, content: bytes):
    def apply(ck):
        with open(os.path.join(ck, name), "wb") as fh:
            fh.write(content)
    return apply


def remove(name: str):
    return lambda ck: os.remove(os.path.join(ck, name))


def resume_true(damage):
    """A damaged checkpoint-1 in output_dir and a recipe resuming from the newest checkpoint."""
    return lambda w: (w.checkpoint(damage), [w.recipe(set_("training.resume_from_checkpoint", True))])[1]


# (id, build(w) -> argv, env or None, expected substrings (file/line/key and the fix))
CASES = [
    # -- the recipe file ---------------------------------------------------------------------------------------
    ("recipe_missing", lambda w: [os.path.join(w.tmp, "nope.yaml")], ["nope.yaml: recipe file not found"]),
    ("yaml_syntax", lambda w: [w.recipe(text="model:\n  name_or_path: m\ndata: [\n  - a: b\n  c\n")],
     ["recipe.yaml:4:3: YAML syntax error: expected the node content, but found '-'"]),
    ("yaml_tab_indent", lambda w: [w.recipe(text="model:\n\tname_or_path: m\n")],
     ["recipe.yaml:2:1: YAML syntax error"]),
    ("recipe_not_utf8", lambda w: [w.file("r.yaml", b"model:\n  name_or_path: \xff\xfe\n")],
     ["r.yaml:2: not UTF-8 text", "save it as UTF-8"]),
    ("recipe_is_a_list", lambda w: [w.recipe(text="- model\n- data\n")], ["a recipe is a mapping of sections"]),
    ("unknown_section", lambda w: [w.recipe(lambda t: t.update(trainig=t.pop("training")))],
     ["trainig: unknown key; did you mean 'training'?"]),
    ("misspelt_model_key", lambda w: [w.recipe(lambda t: t["model"].update(nme_or_path="x"))],
     ["model.nme_or_path: unknown key; did you mean 'model.name_or_path'?"]),
    ("misspelt_training_key", lambda w: [w.recipe(set_("training.learning_rat", 1e-3))],
     ["training.learning_rat", "did you mean 'training.learning_rate'?"]),
    ("wrong_type_int", lambda w: [w.recipe(set_("training.max_steps", "ten"))], ["training.max_steps", "'ten'"]),
    ("wrong_type_list", lambda w: [w.recipe(set_("data.max_length", [1]))], ["data.max_length: expected int"]),
    ("bad_choice", lambda w: [w.recipe(set_("model.dtype", "float8"))], ["model.dtype", "float8", "bfloat16"]),
    ("missing_section", lambda w: [w.recipe(drop("data"))], ["data: required section is missing"]),
    ("missing_required_key", lambda w: [w.recipe(drop("model.name_or_path"))],
     ["model.name_or_path: required key is missing"]),
    ("empty_sources", lambda w: [w.recipe(set_("data.sources", []))], ["data.sources: needs at least one source"]),
    ("eval_fraction_range", lambda w: [w.recipe(set_("data.eval_fraction", 1.5))],
     ["data.eval_fraction: must be in [0, 1), got 1.5"]),
    ("eval_without_data", lambda w: [w.recipe(set_("training.eval_strategy", "steps"))],
     ["training.eval_strategy: evaluation needs data: set data.eval_sources or data.eval_fraction"]),
    ("token_in_recipe", lambda w: [w.recipe(set_("training.hub_token", "hf_x"))],
     ["training.hub_token", "HF_TOKEN"]),
    ("deepspeed_key", lambda w: [w.recipe(set_("training.deepspeed", "ds.json"))],
     ["training.deepspeed", "set strategy.name"]),
    ("lora_rank_zero", lambda w: [w.recipe(set_("model.lora", {"r": 0}))], ["model.lora.r: must be > 0"]),
    ("max_length_below_2", lambda w: [w.recipe(set_("data.max_length", 1))], ["data.max_length: must be at least 2"]),
    ("duplicate_yaml_key", lambda w: [w.recipe(text=yaml.safe_dump(w.tree(), sort_keys=False)
                                               + "model: {dtype: auto}\n")],
     ["recipe.yaml:", "key 'model' appears twice in one mapping (lines 1 and", "keep one"]),
    ("yaml_alias_bomb", lambda w: [w.recipe(text="a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{n}: &{n} [{', '.join(['*' + p] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi")))],
     ["expands to more than 100000 values"]),
    ("override_index_far_out", lambda w: [w.recipe(), "data.sources.100000000.path=x"],
     ["command line: data.sources.100000000.path: index 100000000 is out of range: the list has 1 entry"]),
    ("learning_rate_inf", lambda w: [w.recipe(), "training.learning_rate=.inf"],
     ["training.learning_rate: expected a finite number, got inf"]),
    ("learning_rate_nan", lambda w: [w.recipe(set_("training.learning_rate", float("nan")))],
     ["training.learning_rate: expected a finite number, got nan"]),
    ("learning_rate_negative", lambda w: [w.recipe(), "training.learning_rate=-1"],
     ["training.learning_rate: must be a finite number > 0, got -1.0"]),
    ("batch_size_zero", lambda w: [w.recipe(set_("training.per_device_train_batch_size", 0))],
     ["training.per_device_train_batch_size: must be at least 1, got 0"]),
    ("accumulation_zero", lambda w: [w.recipe(), "training.gradient_accumulation_steps=0"],
     ["training.gradient_accumulation_steps: must be at least 1, got 0"]),
    ("max_steps_zero", lambda w: [w.recipe(set_("training.max_steps", 0))],
     ["training.max_steps: must be > 0, or -1 to train num_train_epochs, got 0"]),
    ("epochs_zero", lambda w: [w.recipe(both(drop("training.max_steps"), set_("training.num_train_epochs", 0)))],
     ["training.num_train_epochs: must be a finite number > 0 (or set max_steps), got 0"]),
    ("chat_template_path_not_jinja", lambda w: [w.recipe(set_("data.chat_template", w.file("t.txt", "x")))],
     ["data.chat_template:", "t.txt' is neither a Jinja template", "give the path of a .jinja file"]),
    ("override_without_value", lambda w: [w.recipe(), "training.max_steps"],
     ["command line: 'training.max_steps' is not an override; write section.key=value"]),
    ("override_unknown_key", lambda w: [w.recipe(), "training.max_step=3"],
     ["command line: training.max_step: unknown key; did you mean 'training.max_steps'?"]),
    # -- incompatible combinations and the launcher ------------------------------------------------------------
    ("option_of_another_strategy", lambda w: (w.env.update(ACCELERATE_USE_DEEPSPEED="true",
                                                           ACCELERATE_DEEPSPEED_CONFIG_FILE=
                                                           os.path.join(REPO, "accelerate_configs", "zero2.json")),
                                              [w.recipe(both(set_("strategy.name", "zero2"),
                                                             set_("strategy.fsdp_offload_params", True)))])[1],
     ["strategy.fsdp_offload_params: does not apply to strategy 'zero2' (it applies to fsdp)"]),
    ("loss_impl_chunked_lora_head",
     lambda w: [w.recipe(both(set_("model.lora", {"r": 4, "target_modules": ["lm_head"]}),
                              set_("training.loss_impl", "chunked")))],
     ["model.lora.target_modules: reaches lm_head, which training.loss_impl: chunked cannot compute through"]),
    ("loss_impl_chunked_lora_head_by_a_pattern",  # peft's regular expression: it passed check, failed in the run
     lambda w: [w.recipe(both(set_("model.lora", {"r": 4, "target_modules": ".*(q_proj|lm_head)"}),
                              set_("training.loss_impl", "chunked")))],
     ["model.lora.target_modules: reaches lm_head, which training.loss_impl: chunked cannot compute through"]),
    ("loss_impl_unknown", lambda w: [w.recipe(set_("training.loss_impl", "liger"))],
     ["training.loss_impl", "'liger'", "'chunked'", "'fused'"]),
    ("launcher_strategy_mismatch", lambda w: [w.recipe(set_("strategy.name", "fsdp"))],
     ["strategy.name is 'fsdp' but the launcher set up 'ddp'", "--config_file accelerate_configs/fsdp.yaml"]),
    ("launcher_world_size_mismatch", lambda w: [w.recipe(set_("strategy.num_processes", 3))],
     ["strategy.num_processes is 3 but the launcher started 1 processes", "remove strategy.num_processes"]),
    ("offload_with_sgd", lambda w: (w.env.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_CONFIG_FILE=
                                                 os.path.join(REPO, "accelerate_configs", "zero3_offload.json")),
                                    [w.recipe(set_("training.optim", "sgd"))])[1],
     ["training.optim: 'sgd' cannot be used with 'zero3_offload'", "use an adamw_* optim"]),
    ("int8_under_zero2", lambda w: (w.env.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_CONFIG_FILE=
                                                 os.path.join(REPO, "accelerate_configs", "zero2.json")),
                                    [w.recipe(set_("compression.method", "int8"))])[1],
     ["compression.method: 'int8' runs only as a DDP communication hook, not under 'zero2'", "fp16/bf16"]),
    ("powersgd_with_unused_parameters", lambda w: [w.recipe(both(set_("compression.method", "powersgd"),
                                                                 set_("training.ddp_find_unused_parameters", True)))],
     ["training.ddp_find_unused_parameters: must be false with compression.method powersgd"]),
    ("training_arguments_own_rule", lambda w: [w.recipe(set_("training.load_best_model_at_end", True))],
     ["training: TrainingArguments refuses these values: --load_best_model_at_end requires the save and eval "
      "strategy"]),
    ("nvme_path_missing", lambda w: (w.env.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_CONFIG_FILE=
                                                  os.path.join(REPO, "accelerate_configs", "zero_infinity.json")),
                                     [w.recipe(set_("strategy.nvme_path", os.path.join(w.tmp, "nvme")))])[1],
     ["strategy.nvme_path:", "nvme does not exist; create it on a local NVMe disk"]),
    ("nvme_path_is_a_file", lambda w: (w.env.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_CONFIG_FILE=
                                                    os.path.join(REPO, "accelerate_configs", "zero_infinity.json")),
                                       [w.recipe(set_("strategy.nvme_path", w.file("nvme", "")))])[1],
     ["strategy.nvme_path:", "nvme is not a folder"]),
    ("rank_timeout_negative", lambda w: [w.recipe(set_("strategy.rank_timeout", -1))],
     ["strategy.rank_timeout: must be 0 (off) or at least 10 seconds, got -1"]),
    ("rank_timeout_too_short", lambda w: [w.recipe(set_("strategy.rank_timeout", 3))],
     ["strategy.rank_timeout: must be 0 (off) or at least 10 seconds, got 3"]),
    ("rank_timeout_not_a_number", lambda w: [w.recipe(set_("strategy.rank_timeout", "soon"))],
     ["strategy.rank_timeout", "'soon'"]),
    ("machine_rank_out_of_range", lambda w: [w.recipe(both(set_("strategy.num_machines", 2),
                                                           set_("strategy.machine_rank", 2)))],
     ["strategy.machine_rank: must be 0 .. 1 (strategy.num_machines is 2), got 2"]),
    ("num_processes_not_per_machine", lambda w: [w.recipe(both(set_("strategy.num_machines", 2),
                                                               set_("strategy.num_processes", 3)))],
     ["strategy.num_processes: is the processes of all machines together, and must be a multiple of "
      "strategy.num_machines (2), got 3"]),
    ("num_machines_zero", lambda w: [w.recipe(set_("strategy.num_machines", 0))],
     ["strategy.num_machines: must be at least 1, got 0"]),
    ("unknown_strategy", lambda w: [w.recipe(set_("strategy.name", "zero4"))], ["strategy.name", "'zero4'", "'zero3'"]),
    # -- the device mesh (strategy.dp_replicate_size, dp_shard_size, tp_size, cp_size) ---------------------------
    ("mesh_degrees_that_do_not_make_the_world",
     lambda w: fsdp_mesh(w, num_processes=4, dp_replicate_size=2, dp_shard_size=3),
     ["strategy.dp_shard_size: strategy.dp_replicate_size (2) x strategy.dp_shard_size (3) must equal "
      "strategy.num_processes (4): set it to 2"]),
    ("mesh_replicas_of_an_unsharded_model", lambda w: fsdp_mesh(w, num_processes=2, dp_replicate_size=2),
     ["strategy.dp_replicate_size: 2 replicas of an unsharded model is DDP: use strategy.name: ddp"]),
    ("mesh_tensor_parallel_with_fsdp", lambda w: fsdp_mesh(w, num_processes=4, tp_size=2, save_only_model=True),
     ["strategy.tp_size: tensor parallelism with FSDP2", "ReplicateParallel, which transformers 5.24 removed",
      "Use strategy.name: ddp with strategy.tp_size equal to strategy.num_processes"]),
    ("mesh_tensor_parallel_beside_replicas", lambda w: [w.recipe(mesh(name="ddp", num_processes=4, tp_size=2,
                                                                      save_only_model=True))],
     ["strategy.tp_size: must equal strategy.num_processes (4) under ddp"]),
    ("mesh_tensor_parallel_over_heads_it_cannot_split",
     lambda w: [w.recipe(mesh(name="ddp", num_processes=2, tp_size=2, save_only_model=True))],
     ["strategy.tp_size: 2 does not divide the model's 1 key/value heads", "choose a divisor of 1"]),
    ("mesh_tensor_parallel_checkpoints_with_optimizer_state",
     lambda w: [w.recipe(mesh(name="ddp", num_processes=2, tp_size=2))],
     ["training.save_only_model: must be true with strategy.tp_size", "training.save_strategy: no"]),
    ("mesh_context_parallel", lambda w: fsdp_mesh(w, cp_size=2),
     ["strategy.cp_size: context parallelism is rendered into the accelerate config but not run by hftrain yet",
      "no DTensor sharding rule for _scaled_dot_product_flash_attention_for_cpu"]),
    ("eval_fraction_and_sources", lambda w: [w.recipe(both(set_("data.eval_fraction", 0.1),
                                                           set_("data.eval_sources", [{"path": DEMO_TRAIN}])))],
     ["data.eval_fraction: set either data.eval_fraction or data.eval_sources, not both"]),
    ("exact_match_without_eval", lambda w: [w.recipe(set_("eval.exact_match", 4))],
     ["eval.exact_match: needs held-out data"]),
    ("batch_larger_than_data", lambda w: [w.data("two.jsonl", GOOD_LINE + "\n" + GOOD_LINE + "\n"),
                                          "training.per_device_train_batch_size=4",
                                          "training.dataloader_drop_last=true"],
     ["one optimizer step needs 4 examples", "the data has 2. Lower one of those or add data"]),
    # -- the model ---------------------------------------------------------------------------------------------
    ("experts_implementation_of_a_dense_model", lambda w: [w.recipe(set_("model.experts_implementation", "eager"))],
     ["model.experts_implementation:", "has no experts whose implementation transformers can set", "remove it"]),
    ("model_path_missing", lambda w: [w.recipe(set_("model.name_or_path", "./no/such/model"))],
     ["model.name_or_path: ./no/such/model does not exist", "check the spelling or build it first"]),
    ("pickle_only_weights", lambda w: [w.recipe(set_("model.name_or_path", w.pickled_model()))],
     ["model.name_or_path:", "holds pickle weights only (pytorch_model.bin)", "convert it once"]),
    ("tokenizer_path_missing", lambda w: [w.recipe(set_("model.tokenizer_name_or_path", "/no/tok"))],
     ["model.tokenizer_name_or_path: /no/tok does not exist"]),
    ("chat_template_file_missing", lambda w: [w.recipe(set_("data.chat_template", "/no/t.jinja"))],
     ["data.chat_template: /no/t.jinja does not exist; give an existing .jinja file"]),
    # -- the data ----------------------------------------------------------------------------------------------
    ("data_missing", lambda w: [w.recipe(set_("data.sources", [{"path": "./no/train.jsonl"}]))],
     ["data.sources.0.path: ./no/train.jsonl does not exist"]),
    ("data_empty", lambda w: [w.data("empty.jsonl", "")],
     ["data.sources.0.path:", "empty.jsonl is empty; fill it or remove this source"]),
    ("data_malformed_line", lambda w: [w.data("bad.jsonl", GOOD_LINE + "\n" + GOOD_LINE + "\n{\"messages\": [\n")],
     ["data.sources.0.path:", "bad.jsonl:3: malformed JSON"]),
    ("data_not_utf8", lambda w: [w.data("latin1.jsonl", GOOD_LINE.encode() + b"\n" + '{"text": "caf\xe9"}\n'.encode(
        "latin-1"))], ["data.sources.0.path:", "latin1.jsonl:2: not UTF-8"]),
    ("data_line_of_9_mib", lambda w: [w.data("huge.jsonl", GOOD_LINE + "\n" + '{"text": "' + "a" * (9 << 20) + '"}\n')],
     ["data.sources.0.path:", "huge.jsonl:2: a line of more than 8 MiB", "split the document into several rows"]),
    ("data_malformed_json_array", lambda w: [w.data("arr.json", '[\n  {"text": "a"},\n  {"text": }\n]\n')],
     ["data.sources.0.path:", "arr.json:3: malformed JSON"]),
    ("data_unknown_extension", lambda w: [w.data("train.txt", "hello\n")],
     ["data.sources.0.path", "use .jsonl, .json, .parquet or .csv"]),
    ("data_missing_column", lambda w: [w.data("c.jsonl", GOOD_LINE + "\n", columns={"messages": "conversations"})],
     ["data.sources.0.columns: ['conversations'] not in", "(columns: ['messages'])"]),
    ("data_undetectable_format", lambda w: [w.data("q.jsonl", json.dumps({"question": "a", "answer": "b"}) + "\n")],
     ["data.sources.0.format: cannot detect the format", "map yours with data.sources.0.columns"]),
    ("data_format_needs_columns", lambda w: [w.data("m.jsonl", GOOD_LINE + "\n", format="prompt_completion")],
     ["data.sources.0: format 'prompt_completion' needs column(s) ['prompt', 'completion']"]),
    ("data_unknown_role", lambda w: [w.data("r.jsonl", GOOD_LINE + "\n" + json.dumps(
        {"messages": [MSG, {"role": "bot", "content": "b a"}]}) + "\n")],
     ["data.sources.0:", "r.jsonl:2: messages[1]: unknown role 'bot'; map it with data.sources.0.roles"]),
    ("data_json_array_bad_row", lambda w: [w.data("a.json", json.dumps([{"messages": [MSG, ANS]}, {"text": 5}]))],
     ["data.sources.0:", "a.json index 1: mixed layouts: this row is"]),
    ("no_trainable_token", lambda w: [w.data("n.jsonl", json.dumps({"messages": [MSG]}) + "\n")],
     ["data.sources.0: 1 of 1 examples", "have no trainable token", "set data.skip_untrainable: true"]),
    ("max_length_below_every_prompt", lambda w: [w.recipe(), "data.max_length=4"],
     ["have no trainable token", "truncation to data.max_length=4. Raise data.max_length"]),
    ("every_example_too_long", lambda w: [w.recipe(), "data.max_length=4", "data.truncation=drop"],
     ["every example of", "is longer than data.max_length=4; raise data.max_length, or set data.truncation: right"]),
    # -- output_dir and checkpoints ----------------------------------------------------------------------------
    ("model_config_not_json", lambda w: [w.recipe(set_("model.name_or_path", w.broken_model("config.json", b"{bad")))],
     ["model.name_or_path:", "config.json is not a readable JSON object", "restore the folder or save it again"]),
    ("model_weights_cut_short", lambda w: [w.recipe(set_("model.name_or_path", w.broken_model("model.safetensors",
                                                                                               cut=1000)))],
     ["model.name_or_path:", "model.safetensors: truncated"]),
    ("model_tokenizer_garbage", lambda w: [w.recipe(set_("model.name_or_path", w.broken_model("tokenizer.json",
                                                                                               b"garbage")))],
     ["model.name_or_path: cannot load a tokenizer from", "check its tokenizer files"]),
    ("output_dir_under_a_file",
     lambda w: [w.recipe(set_("training.output_dir", os.path.join(w.file("f", "x"), "out")))],
     ["training.output_dir:", "cannot be created:", "is not a folder; choose another path"]),
    ("output_dir_is_the_base_model", lambda w: [w.recipe(set_("training.output_dir", w.model))],
     ["training.output_dir:", "is model.name_or_path's folder", "the final save would overwrite it"]),
    ("output_dir_inside_the_base_model", lambda w: [w.recipe(set_("training.output_dir", os.path.join(w.model, "o")))],
     ["training.output_dir:", "overlaps model.name_or_path's folder"]),
    ("output_dir_is_root", lambda w: [w.recipe(set_("training.output_dir", "/"))],
     ["training.output_dir: / is the filesystem root; give the run a folder of its own"]),
    ("output_dir_holds_a_finished_run", lambda w: (w.file("out/run_info.json", "{}"), [w.recipe()])[1],
     ["training.output_dir:", "holds a finished run (run_info.json)", "training.overwrite_output_dir: true"]),
    ("output_dir_holds_an_unfinished_run", lambda w: (w.checkpoint(), [w.recipe()])[1],
     ["training.output_dir:", "holds a run that did not finish (checkpoint-1)",
      "training.resume_from_checkpoint: true", "training.overwrite_output_dir: true"]),
    ("output_dir_holds_other_files", lambda w: (w.file("out/notes.txt", "mine"), [w.recipe()])[1],
     ["training.output_dir:", "holds files hftrain did not write (notes.txt)"]),
    ("overwrite_output_dir_not_a_bool", lambda w: [w.recipe(set_("training.overwrite_output_dir", "yes please"))],
     ["training.overwrite_output_dir"]),
    ("resume_without_checkpoint", lambda w: [w.recipe(set_("training.resume_from_checkpoint", True))],
     ["training.resume_from_checkpoint is true but", "holds no complete checkpoint-N folder"]),
    ("resume_path_missing", lambda w: [w.recipe(set_("training.resume_from_checkpoint", "/no/checkpoint-5"))],
     ["training.resume_from_checkpoint: cannot resume from /no/checkpoint-5"]),
    ("resume_truncated_safetensors", lambda w: [w.recipe(set_("training.resume_from_checkpoint",
                                                              w.checkpoint(unverified(truncate_weights))))],
     ["training.resume_from_checkpoint: cannot resume from", "model.safetensors: truncated"]),
    ("resume_true_only_corrupt", resume_true(unverified(truncate_weights)),
     ["holds no complete checkpoint-N folder (skipping incomplete checkpoint",
      "checkpoint-1/model.safetensors: truncated"]),
    ("resume_half_written", resume_true(unverified(remove("trainer_state.json"))),
     ["checkpoint-1 has no trainer_state.json (the save did not finish)"]),
    # -- verified checkpoints (hftrain_manifest.json): damage after the save is refused by name, never skipped --
    ("resume_flipped_optimizer_byte", resume_true(flip_byte("optimizer.pt")),
     ["training.resume_from_checkpoint: cannot resume from", "checkpoint-1/optimizer.pt: sha256 differs from the "
      "manifest (the file changed after the save)", "set training.resume_from_checkpoint to its path",
      "set training.resume_weights_only: true"]),
    ("resume_flipped_weights_byte", resume_true(flip_byte("model.safetensors")),
     ["checkpoint-1/model.safetensors: sha256 differs from the manifest", "Resume from another checkpoint"]),
    ("resume_truncated_verified_weights", resume_true(truncate_weights),
     ["cannot resume from", "checkpoint-1/model.safetensors: ", "bytes, the manifest says "]),
    ("resume_scheduler_deleted", resume_true(remove("scheduler.pt")),
     ["checkpoint-1/scheduler.pt: missing (the manifest lists it: it was deleted after the save)"]),
    ("resume_file_added", resume_true(write("pytorch_model.bin", b"x")),
     ["checkpoint-1/pytorch_model.bin: not in the manifest (added after the save)"]),
    ("resume_manifest_garbage", resume_true(write("hftrain_manifest.json", b"{")),
     ["checkpoint-1/hftrain_manifest.json: not a readable manifest (JSONDecodeError"]),
    # -- unverified checkpoints: what the Trainer would load unchecked or re-initialise in silence ------------------
    ("resume_optimizer_missing", resume_true(unverified(remove("optimizer.pt"))),
     ["checkpoint-1/optimizer.pt: missing (the optimizer state); set training.resume_weights_only: true"]),
    ("resume_scheduler_missing", resume_true(unverified(remove("scheduler.pt"))),
     ["checkpoint-1/scheduler.pt: missing (the learning-rate scheduler state)"]),
    ("resume_trainer_state_garbage", resume_true(unverified(write("trainer_state.json", b"{not json"))),
     ["checkpoint-1/trainer_state.json: not a readable trainer state (JSONDecodeError"]),
    ("resume_trainer_state_no_step", resume_true(unverified(write("trainer_state.json", b'{"epoch": 1}'))),
     ["checkpoint-1/trainer_state.json: has no integer global_step"]),
    ("resume_rng_garbage", resume_true(unverified(write("rng_state.pth", b"garbage" * 10))),
     ["checkpoint-1/rng_state.pth: not an RNG state torch can load safely (UnpicklingError); the file is damaged"]),
    ("resume_layout_garbage", resume_true(unverified(write("hftrain_checkpoint.json", b"[1, 2"))),
     ["checkpoint-1/hftrain_checkpoint.json: not readable (JSONDecodeError"]),
    ("resume_weights_only_without_resume", lambda w: [w.recipe(set_("training.resume_weights_only", True))],
     ["training.resume_weights_only: is set but training.resume_from_checkpoint is not"]),
    # -- finite or stop, the engine asked for (tests/test_guards.py has the runs) --------------------------------
    ("max_bad_steps_negative", lambda w: [w.recipe(set_("training.max_bad_steps", -1))],
     ["training.max_bad_steps: must be >= 0", "got -1"]),
    ("max_bad_steps_not_int", lambda w: [w.recipe(set_("training.max_bad_steps", "many"))],
     ["training.max_bad_steps", "'many'"]),
    ("max_bad_steps_under_zero2", lambda w: (w.env.update(ACCELERATE_USE_DEEPSPEED="true",
                                                          ACCELERATE_DEEPSPEED_CONFIG_FILE=
                                                          os.path.join(REPO, "accelerate_configs", "zero2.json")),
                                             [w.recipe(set_("training.max_bad_steps", 2))])[1],
     ["training.max_bad_steps: cannot skip steps under 'zero2'", "set it to 0"]),
    ("use_cpu_drops_deepspeed", lambda w: (w.env.update(ACCELERATE_USE_CPU="true", ACCELERATE_USE_DEEPSPEED="true",
                                                        ACCELERATE_DEEPSPEED_CONFIG_FILE=
                                                        os.path.join(REPO, "accelerate_configs", "zero2.json")),
                                           [w.recipe()])[1],
     ["strategy.name: 'zero2' cannot run with ACCELERATE_USE_CPU=true", "Unset ACCELERATE_USE_CPU"]),
]


@pytest.fixture(scope="module")
def shared_checkpoint(tmp_path_factory, tiny_model_dir):
    """One real single-step checkpoint to copy and damage."""
    from .test_checkpoints import make_trainer

    out = tmp_path_factory.mktemp("ck") / "out"
    make_trainer(tiny_model_dir, out, max_steps=1, save_steps=1).train()
    W.shared_checkpoint = str(out / "checkpoint-1")
    return W.shared_checkpoint


def run_main(argv: list[str], env: dict, monkeypatch) -> int:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    try:
        with exit_on_user_error():
            sft.main(argv)
    except SystemExit as e:
        return e.code
    return 0


def snapshot(out: str) -> dict:
    if not os.path.isdir(out):
        return {}
    return {os.path.relpath(os.path.join(d, f), out): os.path.getsize(os.path.join(d, f))
            for d, _, fs in os.walk(out) for f in fs}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_with_one_clear_message(case, tmp_path, tiny_model_dir, shared_checkpoint, monkeypatch,
                                                     capsys):
    _, build, expected = case
    w = W(str(tmp_path), tiny_model_dir)
    argv = build(w)
    before = snapshot(w.out)
    code = run_main(argv, w.env, monkeypatch)
    err = capsys.readouterr().err
    assert code == 2, f"exit status {code}\n{err[-3000:]}"
    assert err.count("hftrain: error:") == 1 and "Traceback" not in err, err[-3000:]
    message = err[err.index("hftrain: error:"):]
    for s in expected:
        assert s in message, f"{s!r} not in:\n{message}"
    # Nothing written, or nothing changed: no weights, no recipe, existing checkpoints untouched.
    assert snapshot(w.out) == before, f"output_dir changed: {snapshot(w.out)} vs {before}"


@pytest.mark.launches
def test_a_second_run_into_a_folder_in_use_is_refused_naming_the_first(tmp_path, tiny_model_dir, monkeypatch, capsys):
    w = W(str(tmp_path), tiny_model_dir)
    hold = ("import sys, time\nfrom hftrain import outdir\noutdir.claim(sys.argv[1], False, False)\n"
            "print('held', flush=True)\ntime.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", hold, w.out], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        before = snapshot(w.out)
        # Even a resume or an overwrite does not take a folder another run holds.
        code = run_main([w.recipe(set_("training.overwrite_output_dir", True))], {}, monkeypatch)
        err = capsys.readouterr().err
        assert code == 2 and f"is in use by another run (pid {p.pid} on " in err, err[-2000:]
        assert snapshot(w.out) == before
    finally:
        p.kill()
        p.wait()


@pytest.mark.launches
def test_unwritable_output_dir_on_a_read_only_filesystem(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """Permissions do not stop root; a read-only mount does."""
    ro = tmp_path / "ro"
    mount_tmpfs(ro, "ro,size=64k")
    try:
        w = W(str(tmp_path), tiny_model_dir)
        code = run_main([w.recipe(set_("training.output_dir", str(ro / "out")))], {}, monkeypatch)
        err = capsys.readouterr().err
        assert code == 2, err[-3000:]
        assert f"training.output_dir: cannot write in {ro}" in err and "Read-only file system" in err, err
        assert not os.path.exists(ro / "out")
    finally:
        subprocess.run(["umount", str(ro)], check=False)


def mount_tmpfs(path, options: str):
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()})")


@pytest.mark.launches
def test_a_full_datasets_cache_is_named_and_left_clean(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """The disk of the datasets cache fills while tokenising: one clear error naming the folder, no temporary file
    left there, nothing written to output_dir."""
    import datasets

    cache = tmp_path / "dscache"
    mount_tmpfs(cache, "size=64k")
    try:
        monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
        w = W(str(tmp_path), tiny_model_dir)
        code = run_main([w.recipe()], {}, monkeypatch)
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err, err[-3000:]
        assert f"data.sources.0: no space left in the datasets cache {cache}/hftrain" in err, err[-2000:]
        assert "point HF_DATASETS_CACHE at a larger disk" in err
        assert os.listdir(cache / "hftrain") == []
        assert shutil.disk_usage(cache).free > 60 << 10  # the partial file is closed too, its space given back
        assert not os.path.exists(w.out)
    finally:
        subprocess.run(["umount", str(cache)], check=False)


@pytest.mark.launches
def test_nvme_path_too_small_is_refused_before_loading(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """ZeRO-Infinity swaps ~20 bytes per parameter: a 64 KiB disk cannot hold the tiny model's ~1 MiB."""
    nvme = tmp_path / "nvme"
    mount_tmpfs(nvme, "size=64k")
    try:
        w = W(str(tmp_path), tiny_model_dir)
        env = {"ACCELERATE_USE_DEEPSPEED": "true",
               "ACCELERATE_DEEPSPEED_CONFIG_FILE": os.path.join(REPO, "accelerate_configs", "zero_infinity.json")}
        code = run_main([w.recipe(set_("strategy.nvme_path", str(nvme)))], env, monkeypatch)
        err = capsys.readouterr().err
        assert code == 2, err[-3000:]
        assert f"strategy.nvme_path: {nvme} has 0.1 MiB free but the swap needs about" in err, err
        assert "free space or choose a larger disk" in err and not os.path.exists(w.out)
    finally:
        subprocess.run(["umount", str(nvme)], check=False)


@pytest.mark.parametrize("command", ["check", "launch"])
def test_cli_refuses_the_same_way(command, tmp_path, tiny_model_dir, capsys):
    """`hftrain check` / `hftrain launch` run the same checks and exit 2 with one message, before any process."""
    from hftrain.cli import main

    w = W(str(tmp_path), tiny_model_dir)
    if command == "check":
        argv, expected = ["check", w.recipe(text="model: {name_or_path: m\n")], "recipe.yaml:2:1: YAML syntax error"
    else:
        argv = ["launch", w.recipe(set_("training.resume_from_checkpoint", True)), "--dry-run"]
        expected = "training.resume_from_checkpoint is true but"
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and expected in err and "Traceback" not in err, err
    assert not os.path.exists(w.out)


# Cases only the launched run can see: what the launcher set up against what the recipe asks for.
RUN_ONLY = {"launcher_strategy_mismatch", "launcher_world_size_mismatch",
            # check sees ACCELERATE_USE_CPU of its own shell (test_guards), this table sets it for the run only
            "use_cpu_drops_deepspeed"}


def pin_launcher(argv: list[str], env: dict) -> None:
    """Write what check cannot see, the launcher's strategy (its DeepSpeed JSON) and world size (1: these runs are
    in-process), into the recipe file itself as the keys that name them, so that check and the run read one file."""
    from hftrain.config import strategy_of_deepspeed_config

    try:
        with open(argv[0], encoding="utf-8") as fh:
            tree = yaml.safe_load(fh)
    except (OSError, ValueError, yaml.YAMLError):
        return
    if not isinstance(tree, dict):
        return
    strategy = tree.setdefault("strategy", {})
    strategy["num_processes"] = 1
    if "ACCELERATE_DEEPSPEED_CONFIG_FILE" in env:
        with open(env["ACCELERATE_DEEPSPEED_CONFIG_FILE"]) as fh:
            strategy["name"] = strategy_of_deepspeed_config(json.load(fh))
    with open(argv[0], "w", encoding="utf-8") as fh:
        yaml.safe_dump(tree, fh, sort_keys=False)


def run_check(argv: list[str], capsys) -> tuple[int, str]:
    from hftrain.cli import main

    try:
        code = main(["check", *argv])
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("case", [c for c in CASES if c[0] not in RUN_ONLY],
                         ids=[c[0] for c in CASES if c[0] not in RUN_ONLY])
def test_check_and_the_run_refuse_alike(case, tmp_path, tiny_model_dir, shared_checkpoint, monkeypatch, capsys):
    """One validation path: `hftrain check` refuses every case of the table with the very message the run gives."""
    _, build, _ = case
    w = W(str(tmp_path), tiny_model_dir)
    argv = build(w)
    pin_launcher(argv, w.env)
    before = snapshot(w.out)
    code, err = run_check(argv, capsys)
    assert code == 2, f"check accepted what the run refuses (exit {code})\n{err[-3000:]}"
    assert snapshot(w.out) == before
    checked = err[err.index("hftrain: error:"):]
    code = run_main(argv, w.env, monkeypatch)
    err = capsys.readouterr().err
    assert code == 2
    assert err[err.index("hftrain: error:"):] == checked


def test_check_accepts_what_the_run_accepts(tmp_path, tiny_model_dir, capsys):
    """The negative control of the table: a good recipe passes check (data phase included) and prints it resolved."""
    from hftrain.cli import main

    w = W(str(tmp_path), tiny_model_dir)
    assert main(["check", w.recipe(), "strategy.num_processes=1"]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["model"]["name_or_path"] == tiny_model_dir
    assert not os.path.exists(w.out)


def _end_on_error(capsys, monkeypatch, local_rank: int) -> str:
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("RANK", str(local_rank))
    with pytest.raises(SystemExit) as e, exit_on_user_error():
        raise DataError("data.sources.0.path: no such file")
    assert e.value.code == 2
    return capsys.readouterr().err


def test_a_sibling_rank_waits_for_its_machines_first_rank_to_say_the_error(capsys, monkeypatch, tmp_path):
    """A sibling rank that exited first could have the launcher end rank 0 before it printed (CI saw a job fail with no
    message): the sibling exits silently once rank 0 has said it, and says it itself, named, when rank 0 never does."""
    from hftrain import errors
    monkeypatch.setattr(errors.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(errors, "SILENT_RANK_GRACE_S", 0.3)
    assert _end_on_error(capsys, monkeypatch, 1) == "[rank 1] hftrain: error: data.sources.0.path: no such file\n"
    assert _end_on_error(capsys, monkeypatch, 0) == "hftrain: error: data.sources.0.path: no such file\n"
    assert _end_on_error(capsys, monkeypatch, 1) == ""  # rank 0's marker: said once
    os.utime(errors._said_marker(), (errors._IMPORTED_AT - 60, errors._IMPORTED_AT - 60))  # another job's marker
    assert _end_on_error(capsys, monkeypatch, 1).startswith("[rank 1] hftrain: error:")
