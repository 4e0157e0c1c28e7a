"""Aux-loss-free balancing (issue 40, point 2; hftrain/moe/balance.py) in one process: the bias update is the paper's
rule on the loads of real tokens, evaluation does not count, it is opt-in, and a model without biased routers refuses
the key in `hftrain check` and in the run. Across ranks and accumulation: tests/test_moe.py (the aux runs' matrix)."""

import pytest
import torch
import yaml

from hftrain.config import MoeSection, RecipeError
from hftrain.errors import MoeError
from hftrain.launch.preflight import check_recipe
from hftrain.moe import attach
from hftrain.moe.balance import BIAS, BiasBalancer, bias_updates, biased_routers

from .exactness import within
from .test_moe import tiny_family_moe

RATE = 0.25


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe"])
def biased_dir(request, tiny_model_dir, tmp_path_factory):
    return tiny_family_moe(request.param, tiny_model_dir, str(tmp_path_factory.mktemp(request.param)))


def routed(model, ids, mask) -> list[torch.Tensor]:
    """Each biased router's per-expert count of real tokens in one forward, read by a hook of the test's own."""
    counts, handles = [], []
    for r in biased_routers(model):
        def hook(module, args, out, r=r):
            keep = mask.reshape(-1).bool()
            counts.append(torch.bincount(out[2][keep].reshape(-1), minlength=getattr(r, BIAS).shape[0]).double())
        handles.append(r.register_forward_hook(hook))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    for h in handles:
        h.remove()
    return counts


def test_the_bias_update_is_the_papers_rule_on_real_tokens(biased_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(biased_dir, dtype=torch.float32)
    ids = torch.randint(3, model.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # padding: routed by the model, but no load
    mask[2, 4:] = 0
    loads = torch.stack(routed(model, ids, mask))
    assert loads.sum(-1).tolist() == [2 * int(mask.sum())] * 2  # top-2 of every real token, per router
    balancer = BiasBalancer(model, RATE)
    model.train()
    model(input_ids=ids, attention_mask=mask)
    model(input_ids=ids, attention_mask=mask)  # a second micro-batch of the step: loads add up
    model.eval()
    model(input_ids=ids, attention_mask=mask)  # evaluation routes too, but does not count
    assert torch.equal(balancer.loads, 2 * loads)  # padding and evaluation left out
    balancer.on_step_end(None, None, None)
    want = RATE * torch.sign(loads.mean(-1, keepdim=True) - loads)
    assert torch.equal(bias_updates(2 * loads, RATE), want)
    got = torch.stack([getattr(r, BIAS) for r in balancer.routers]).double()
    within("moe_balance.bias_update_vs_rule.biases", got, want)
    assert got.abs().sum() > 0
    assert balancer.loads is None  # counted afresh for the next step
    # the biases now steer the routing: an over-loaded expert is chosen less
    after = torch.stack(routed(model, ids, mask))
    top = loads.argmax(-1)
    assert all(after[i, top[i]] <= loads[i, top[i]] for i in range(len(top)))


def test_balancing_is_opt_in_and_refused_where_routers_have_no_bias(biased_dir, tiny_model_dir):
    """Off unless moe.bias_update_rate asks (one rule for every method: tests/test_moe_refusals.py)."""
    from transformers import AutoModelForCausalLM

    class Trainer:
        def __init__(self, model):
            self.model, self.callbacks = model, []

        def add_callback(self, cb):
            self.callbacks.append(cb)

    biased = Trainer(AutoModelForCausalLM.from_pretrained(biased_dir))
    assert attach(biased, MoeSection(bias_update_rate=0.001))["bias_balancing"] == "2 routers, rate 0.001"
    for cfg in (None, MoeSection(), MoeSection(bias_update_rate=0.0)):  # unset or 0: off
        unasked = Trainer(AutoModelForCausalLM.from_pretrained(biased_dir))
        assert "bias_balancing" not in attach(unasked, cfg)
        assert not any(isinstance(cb, BiasBalancer) for cb in unasked.callbacks)
    dense = Trainer(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    assert attach(dense) == {} and dense.callbacks == []
    with pytest.raises(MoeError, match="moe.bias_update_rate: LlamaForCausalLM has no router with an expert bias"):
        attach(dense, MoeSection(bias_update_rate=0.01))


def test_check_refuses_a_bias_rate_for_a_model_without_biased_routers(tmp_path, tiny_model_dir):
    tree = {"model": {"name_or_path": tiny_model_dir}, "data": {"sources": [{"path": "d.jsonl"}]},
            "training": {"output_dir": str(tmp_path / "o")}, "moe": {"bias_update_rate": 0.01}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(tree))
    with pytest.raises(RecipeError, match="moe.bias_update_rate: LlamaForCausalLM has no router with an expert bias"):
        check_recipe(str(path))
    with pytest.raises(RecipeError, match=r"moe.bias_update_rate: must be >= 0 \(0: off\), got -1"):
        check_recipe(str(path), ["moe.bias_update_rate=-1"])
