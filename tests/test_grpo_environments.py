"""GRPO's environment (grpo.environment, methods/grpo/environments.py), fast: TRL sees the environment's own tools
(names, schemas), a refused action answers the model, and an environment that crashes (its constructor, reset or
get_reward raising, a method past the timeout or exiting) ends that rollout with reward 0, reported and counted,
never a stuck rank or a stopped run; a class TRL could not use is refused naming the key."""

import inspect
import time

import pytest
from transformers.utils import get_json_schema

from hftrain.methods import GrpoSection, RewardSpec, parse_recipe
from hftrain.errors import RewardError
from hftrain.methods.grpo.environments import guarded_environment, load_environment
from hftrain.methods.grpo.user_code import CallCounts, TimeLimit

BASE = {"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d.jsonl"}]}}


class Counter:
    """Count up to a target."""

    fail_reset = fail_init = fail_reward = False

    def __init__(self):
        if Counter.fail_init:
            raise OSError("no room")
        self.value, self.target = 0, None

    def reset(self, target: int = 3, **row):
        if Counter.fail_reset:
            raise KeyError("target")
        self.value, self.target = 0, target
        return f" (target {target})"

    def step(self, by: int) -> str:
        """Add to the counter.

        Args:
            by: How much to add (1 or 2).
        """
        if by not in (1, 2):
            raise ValueError("by must be 1 or 2")
        if by == 2 and self.value == 1:
            time.sleep(60)  # a stuck environment
        self.value += by
        return str(self.value)

    def get_reward(self) -> float:
        if Counter.fail_reward:
            raise ZeroDivisionError("reward")
        return float(self.value == self.target)


@pytest.fixture(autouse=True)
def healthy():
    Counter.fail_reset = Counter.fail_init = Counter.fail_reward = False


def trl_view(instance) -> dict:
    """What TRL's GRPOTrainer takes from an environment instance: its public functions as tools, reset, get_reward."""
    members = dict(inspect.getmembers(type(instance), predicate=inspect.isfunction))
    tools = {n: getattr(instance, n) for n in members if n not in ("reset", "get_reward") and not n.startswith("_")}
    return {"tools": tools, "reset": "reset" in members, "get_reward": "get_reward" in members}


def test_trl_sees_the_environments_own_tools_and_schemas():
    env = guarded_environment(Counter, TimeLimit(0.5, "grpo.tool_timeout"), CallCounts())()
    view = trl_view(env)
    assert set(view["tools"]) == {"step"} and view["reset"] and view["get_reward"]
    assert get_json_schema(view["tools"]["step"]) == get_json_schema(Counter().step)
    assert type(env).__name__ == "Counter"  # TRL logs get_reward under the class's name


def test_a_refused_action_answers_the_model_and_a_crash_ends_the_rollout_with_reward_0(capsys):
    counts = CallCounts()
    env = guarded_environment(Counter, TimeLimit(0.5, "grpo.tool_timeout"), counts)()
    assert env.reset(target=3) == " (target 3)" and env.step(by=1) == "1"
    assert env.step(by=5) == "error: step raised ValueError: by must be 1 or 2" and not env.crashed
    start = time.time()
    assert env.step(by=2) == "error: step did not return within grpo.tool_timeout=0.5 s: the environment crashed"
    # interrupted: far below the 60 s the call takes by itself, whatever the machine's load
    assert time.time() - start < 30 and env.crashed
    assert env.step(by=1).startswith("error: the environment crashed (step did not return within grpo.tool_timeout=")
    assert env.get_reward() == 0.0
    assert counts.take() == {"calls": 4, "errors": 3, "timeouts": 1, "crashes": 1, "cut": 0}
    assert capsys.readouterr().err.count("the GRPO environment crashed") == 1
    assert env.reset(target=2) == " (target 2)" and not env.crashed  # the next rollout: a fresh instance
    assert env.step(by=2) == "2" and env.get_reward() == 1.0


@pytest.mark.parametrize("where", ["init", "reset", "reward"])
def test_an_environment_raising_in_init_reset_or_get_reward_crashes_the_rollout_not_the_run(where):
    counts = CallCounts()
    setattr(Counter, f"fail_{where}", True)
    env = guarded_environment(Counter, TimeLimit(0.5, "grpo.tool_timeout"), counts)()
    env.reset(target=1)
    if where != "reward":
        assert env.crashed and env.step(by=1).startswith("error: the environment crashed")
    assert env.get_reward() == 0.0 and env.crashed
    assert counts.crashes == (2 if where == "init" else 1)  # a constructor that fails is tried again at reset
    setattr(Counter, f"fail_{where}", False)
    env.reset(target=1)
    assert not env.crashed and env.step(by=1) == "1" and env.get_reward() == 1.0


def test_an_environment_trl_cannot_use_is_refused_naming_the_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "envs.py").write_text(
        "class NoReset:\n    def act(self, x: int) -> str:\n        '''Act.\n\n        Args:\n            x: X.\n"
        "        '''\n        return ''\n\n"
        "class Bare:\n    def reset(self, **row):\n        return None\n    def act(self, x):\n        return ''\n\n"
        "class NoReward:\n    def reset(self, **row):\n        return None\n    def act(self, x: int) -> str:\n"
        "        '''Act.\n\n        Args:\n            x: X.\n        '''\n        return ''\n")
    rewards = [RewardSpec(function="exact_match")]
    with pytest.raises(RewardError, match=r"grpo\.environment: envs:NoReset: defines no reset\(\)"):
        load_environment(GrpoSection(rewards=rewards, environment="envs:NoReset"))
    with pytest.raises(RewardError, match=r"its method act: transformers cannot build its JSON schema"):
        load_environment(GrpoSection(rewards=rewards, environment="envs:Bare"))
    with pytest.raises(RewardError, match=r"grpo\.rewards is empty and grpo\.environment envs:NoReward defines no"):
        load_environment(GrpoSection(rewards=[], environment="envs:NoReward"))
    assert load_environment(GrpoSection(rewards=rewards, environment="envs:NoReward")).__name__ == "NoReward"


@pytest.mark.parametrize("grpo,message", [
    ({"environment": "Counter"}, "grpo.environment: 'Counter' is not module:Class"),
    ({"rewards": []}, "grpo.rewards: needs at least one reward function"),
    ({"max_tool_calls": 2}, "grpo.max_tool_calls: limits tool calls, and neither grpo.tools nor grpo.environment"),
])
def test_recipe_rules_of_the_environment(grpo, message):
    found = parse_recipe(None, [], raw={**BASE, "grpo": {"rewards": [{"function": "exact_match"}], **grpo}})[1]
    assert any(f": {message}" in p for p in found), found
    ok = {**BASE, "grpo": {"rewards": [], "environment": "envs:Counter", "max_tool_calls": 2}}
    assert not [p for p in parse_recipe(None, [], raw=ok)[1] if p.startswith("grpo")]


def test_check_calls_the_rewards_with_the_environments_trl_passes_them(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """TRL passes reward functions `environments` (each completion's instance, reset with its row) when a recipe
    has grpo.environment: check's dry run of the rewards refused such a reward (no `environments`), exit 2."""
    import json

    import yaml

    from hftrain.cli import main as cli_main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "game.py").write_text(
        "class Game:\n    def reset(self, **row):\n        self.reference = row['reference']\n"
        "    def act(self, x: int) -> str:\n        '''Act.\n\n        Args:\n            x: X.\n        '''\n"
        "        return ''\n\n"
        "def healthy(prompts, completions, environments, **kw):\n"
        "    assert len(environments) == len(completions) and environments[0].reference == 'b a'\n"
        "    return [float(e.crashed is None) for e in environments]\n")
    row = {"messages": [{"role": "user", "content": "reverse: a b"}, {"role": "assistant", "content": "b a"}]}
    (tmp_path / "d.jsonl").write_text((json.dumps(row) + "\n") * 4)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump({
        "model": {"name_or_path": tiny_model_dir},
        "data": {"sources": [{"path": "d.jsonl"}], "max_length": 1024, "chat_template": "trl:qwen2_5"},
        "grpo": {"rewards": [{"function": "game:healthy"}], "environment": "game:Game", "num_generations": 2,
                 "max_completion_length": 16},
        "training": {"output_dir": str(tmp_path / "o"), "per_device_train_batch_size": 2}}))
    assert cli_main(["check", "r.yaml"]) == 0, capsys.readouterr().err[-2000:]
