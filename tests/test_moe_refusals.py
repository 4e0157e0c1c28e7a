"""Issue 54, MoE: every `moe:` key asked of a family that cannot honour it, or of a strategy the expert-parallel layer
cannot run under, is refused by `hftrain check` and by the run alike (exit 2, the same message, naming the key and
the fix, before the model loads, nothing written), where it used to pass check and end in a traceback (moe.aux_loss_coef
on DeepSeek-V3 / GLM-4.5) or be accepted and ignored (model.experts_implementation under expert parallelism). Bias
balancing is one rule for every method (opt-in), said in one line."""

import pytest
import torch

from hftrain.config import MoeSection
from hftrain.methods import load_recipe, method_of
from hftrain.moe import attach
from hftrain.moe.balance import BiasBalancer, balancing_line, resolved_rate
from hftrain.moe.capabilities import computes_aux_loss

from .test_bad_input import W, both, run_check, run_main, set_, snapshot
from .test_moe import AUX_FAMILIES, BIASED, tiny_family_moe


@pytest.fixture(scope="module")
def family_dirs(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("families")
    return {f: tiny_family_moe(f, tiny_model_dir, str(tmp / f)) for f in (*BIASED, "qwen3_moe", "mixtral")}


@pytest.mark.parametrize("family", (*BIASED, *AUX_FAMILIES, "mixtral"))
def test_which_families_return_an_aux_loss_is_read_right(family, tiny_model_dir, tmp_path):
    """computes_aux_loss (what check judges on the meta device) against the family's real forward with
    output_router_logits: DeepSeek-V3 and GLM-4.5 return no aux_loss, the others one."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_family_moe(family, tiny_model_dir, str(tmp_path / family)))
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[3, 5, 7, 9]]), output_router_logits=True)
    assert computes_aux_loss(model) == (out.aux_loss is not None) == (family not in BIASED)


def _ep():
    return both(set_("moe", {"expert_parallel_size": 2}), set_("strategy", {"num_processes": 2}))


# (id, model family (None: the tiny dense Llama), recipe edits, what the refusal says)
CASES = [
    *[(f"aux_loss_on_{f}", f, lambda w: set_("moe", {"aux_loss_coef": 0.01}),
       ["moe.aux_loss_coef: ", "computes no load-balancing loss", "set moe.bias_update_rate"]) for f in BIASED],
    ("z_loss_on_a_dense_model", None, lambda w: set_("moe", {"router_z_loss_coef": 0.01}),
     ["moe.router_z_loss_coef: LlamaForCausalLM has no MoE router", "set moe.upcycle"]),
    ("capacity_factor_on_deepseek", "deepseek_v3", lambda w: set_("moe", {"capacity_factor": 1.0}),
     ["moe.capacity_factor: DeepseekV3MoE has a shared expert"]),
    ("capacity_factor_under_fsdp", "mixtral", lambda w: both(set_("moe", {"capacity_factor": 1.0}),
                                                             set_("strategy", {"name": "fsdp"})),
     ["moe.capacity_factor: needs the whole MoE block on each rank, which 'fsdp' shards"]),
    ("expert_parallel_with_fsdp_offload", "mixtral",
     lambda w: both(_ep(), set_("strategy", {"name": "fsdp", "num_processes": 2, "fsdp_offload_params": True})),
     ["strategy.fsdp_offload_params: cannot be combined with moe.expert_parallel_size > 1", "mixes CPU and GPU"]),
    ("per_expert_names_on_fused_experts", "qwen3_moe",
     lambda w: set_("model.lora", {"r": 4, "target_parameters": ["experts.gate_proj", "experts.up_proj",
                                                                 "experts.down_proj"]}),
     ["model.lora.target_parameters: 'experts.gate_proj', 'experts.up_proj' name no parameter of",
      "mlp.experts.gate_up_proj"]),
    ("upcycle_an_moe_model", "mixtral", lambda w: set_("moe", {"upcycle": {"num_experts": 4}}),
     ["moe.upcycle: ", "is already a mixture-of-experts model (mixtral, 3 MoE blocks)", "remove moe.upcycle"]),
    ("experts_implementation_under_expert_parallelism", "mixtral",
     lambda w: both(_ep(), set_("model.experts_implementation", "grouped_mm")),
     ["model.experts_implementation: 'grouped_mm' is not used with moe.expert_parallel_size",
      "remove model.experts_implementation, or set it to 'eager'"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_check_and_the_run_refuse_what_the_family_or_strategy_cannot_honour(case, family_dirs, tiny_model_dir,
                                                                             tmp_path, monkeypatch, capsys):
    _, family, edit, expected = case
    w = W(str(tmp_path), family_dirs[family] if family else tiny_model_dir)
    argv = [w.recipe(edit(w))]
    code, err = run_check(argv, capsys)
    assert code == 2 and "Traceback" not in err, f"check: exit {code}\n{err[-3000:]}"
    checked = err[err.index("hftrain: error:"):]
    for s in expected:
        assert s in checked, f"{s!r} not in:\n{checked}"
    before = snapshot(w.out)
    code = run_main(argv, {}, monkeypatch)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, f"run: exit {code}\n{err[-3000:]}"
    # the same lines; a recipe for 2 processes or FSDP run in this one process also hears that the launch differs
    for line in checked.splitlines()[1:]:
        assert line in err, f"{line!r} not in the run's:\n{err[-3000:]}"
    assert snapshot(w.out) == before


def test_what_each_family_can_honour_passes(family_dirs, tmp_path, capsys):
    """The refusals are for the families that cannot: the z-loss on DeepSeek-V3 (it returns its router logits), the
    aux loss on Qwen3-MoE, eager experts under expert parallelism."""
    for family, edit in (("deepseek_v3", set_("moe", {"router_z_loss_coef": 0.01, "bias_update_rate": 0.001})),
                         ("qwen3_moe", set_("moe", {"aux_loss_coef": 0.01})),
                         ("mixtral", both(_ep(), set_("model.experts_implementation", "eager")))):
        w = W(str(tmp_path / family), family_dirs[family])
        (tmp_path / family).mkdir()
        code, err = run_check([w.recipe(edit)], capsys)
        assert code == 0, err[-3000:]


def test_a_biased_router_lora_wraps_is_balanced(family_dirs, tmp_path, capsys, monkeypatch):
    """peft's all-linear wraps DeepSeek-V3's router (a ParamWrapper): check passed, the run then refused the bias
    rate ('no router with an expert bias'). The wrapped router is found through its wrapper: check and the run pass,
    and its biases move (they start at 0)."""
    from safetensors.torch import load_file

    from hftrain.moe.balance import BIAS

    w = W(str(tmp_path), family_dirs["deepseek_v3"])
    rec = w.recipe(both(set_("moe", {"bias_update_rate": 0.05}),
                        set_("model.lora", {"r": 4, "dropout": 0.0, "merge": True}), set_("training.max_steps", 2)))
    code, err = run_check([rec], capsys)
    assert code == 0, err[-3000:]
    assert run_main([rec], {}, monkeypatch) == 0, capsys.readouterr().err[-3000:]
    merged = load_file(str(tmp_path / "out" / "merged" / "model.safetensors"))
    biases = [v for k, v in merged.items() if k.endswith(BIAS)]
    assert biases and any(v.abs().max() > 0 for v in biases)


class _Trainer:
    def __init__(self, model):
        self.model, self.callbacks = model, []

    def add_callback(self, cb):
        self.callbacks.append(cb)


def test_bias_balancing_is_one_rule_for_every_method(family_dirs):
    """SFT used to move a DeepSeek-V3's router biases by default and DPO / GRPO never: now no method moves them unless
    moe.bias_update_rate asks, and the run says which in one line (lifecycle prints balancing_line for every method)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(family_dirs["deepseek_v3"])
    base = ["model.name_or_path=m", "data.sources.0.path=d"]
    sft = load_recipe(None, base, raw={})
    dpo = load_recipe(None, [*base, "preference.beta=0.1"], raw={})
    assert (method_of(sft).name, method_of(dpo).name) == ("sft", "dpo")
    assert resolved_rate(sft.moe) == resolved_rate(dpo.moe) == 0.0
    line = balancing_line(model, sft.moe)
    assert line == balancing_line(model, dpo.moe) and line.startswith("moe: router bias balancing off: the 2 routers")
    trainer = _Trainer(model)
    attach(trainer, sft.moe)  # SFT's attach, with the recipe's (absent) moe: section
    assert not any(isinstance(cb, BiasBalancer) for cb in trainer.callbacks)
    asked = MoeSection(bias_update_rate=0.01)
    assert balancing_line(model, asked) == "moe: router bias balancing on: 2 routers, rate 0.01 (moe.bias_update_rate)"
    done = attach(trainer, asked)
    assert done["bias_balancing"] == "2 routers, rate 0.01"
    assert [cb.rate for cb in trainer.callbacks if isinstance(cb, BiasBalancer)] == [0.01]
