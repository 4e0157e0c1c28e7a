"""The house plan, enforced: imports go one way (the import-linter contract in pyproject.toml), no import cycle,
no function-local import of hftrain's own modules, modules and recipe scripts that stay readable in one sitting."""

import ast
import glob
import os
import re

import grimp
import pytest
from importlinter.cli import lint_imports

from hftrain.heads import Role
from hftrain.methods import METHODS, SCRIPTS

from .conftest import REPO

PACKAGE = os.path.join(REPO, "hftrain")
SOURCES = sorted(glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True))


def test_import_linter_contract_is_kept(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    code = lint_imports(config_filename=os.path.join(REPO, "pyproject.toml"), no_cache=True)
    assert code == 0, capsys.readouterr().out[-4000:]


def method_families() -> list[str]:
    """The sub-packages of hftrain/methods/: one family of methods each (preference, grpo, ...)."""
    root = os.path.join(PACKAGE, "methods")
    return sorted(f"hftrain.methods.{name}" for name in os.listdir(root)
                  if os.path.isfile(os.path.join(root, name, "__init__.py")))


def test_the_method_families_are_independent(monkeypatch, capsys, tmp_path):
    """Every sub-package of methods/ (found on disk: a new family needs no edit of a contract) imports no other; what
    they share (base.Method, the policy, the registry, SFT) lives at the top of methods/."""
    assert len(method_families()) >= 2, method_families()
    config = tmp_path / "families.toml"
    config.write_text('[tool.importlinter]\nroot_package = "hftrain"\n\n[[tool.importlinter.contracts]]\n'
                      'name = "methods: each family (a sub-package of methods/) is independent of the others"\n'
                      f'type = "independence"\nmodules = {method_families()!r}\n'.replace("'", '"'))
    monkeypatch.chdir(REPO)
    code = lint_imports(config_filename=str(config), no_cache=True)
    assert code == 0, capsys.readouterr().out[-4000:]


def test_no_import_cycle_between_modules():
    graph = grimp.build_graph("hftrain")
    edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(m, path):
        state[m] = 1
        for n in sorted(edges.get(m, ())):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])


def function_local_imports(path: str) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if isinstance(sub, ast.ImportFrom) and (sub.level > 0 or (sub.module or "").startswith("hftrain")):
                    found.append((sub.lineno, ast.unparse(sub)))
                elif isinstance(sub, ast.Import) and any(a.name.startswith("hftrain") for a in sub.names):
                    found.append((sub.lineno, ast.unparse(sub)))
    return found


def private_imports(source: str) -> list[str]:
    """`from <an hftrain module> import _name`: a private name used by another module (a name two modules share is
    public, and says so by its spelling)."""
    return [f"{node.lineno}: {ast.unparse(node)}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").startswith("hftrain"))
            and any(a.name.startswith("_") and not a.name.startswith("__") for a in node.names)]


def test_no_module_imports_another_s_private_name():
    found = {os.path.relpath(path, REPO): private_imports(open(path, encoding="utf-8").read()) for path in SOURCES}
    assert {path: lines for path, lines in found.items() if lines} == {}


def test_the_private_import_check_sees_one():
    assert private_imports("from .model import _from_pretrained, load_model\nfrom . import __version__\n") == [
        "1: from .model import _from_pretrained, load_model"]


@pytest.mark.parametrize("path", SOURCES, ids=[os.path.relpath(p, REPO) for p in SOURCES])
def test_no_function_local_import_of_hftrain(path):
    """A function-local import of hftrain's own modules hides a cycle; only optional or heavy libraries are
    imported inside functions."""
    assert function_local_imports(path) == []


def test_the_check_sees_a_function_local_import(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("def f():\n    from .config import Recipe\n    import hftrain.data\n    import json\n")
    assert [line for line, _ in function_local_imports(str(p))] == [2, 3]


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 350, 60


@pytest.mark.parametrize("path", SOURCES, ids=[os.path.relpath(p, REPO) for p in SOURCES])
def test_modules_stay_small(path):
    n = sum(1 for _ in open(path, encoding="utf-8"))
    assert n <= MAX_MODULE_LINES, f"{os.path.relpath(path, REPO)} has {n} lines; split it by what it does"


def long_functions(path: str) -> list[str]:
    return [f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


@pytest.mark.parametrize("path", SOURCES, ids=[os.path.relpath(p, REPO) for p in SOURCES])
def test_functions_stay_short(path):
    assert long_functions(path) == [], "read at once, or split by what they do"


def test_the_function_check_sees_a_long_function(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES + "\n\ndef g():\n    pass\n")
    assert long_functions(str(p)) == [f"f ({MAX_FUNCTION_LINES + 1} lines, line 1)"]


# Names more than one module may have: a package's __init__, each feature package's trainer mixin (mixin.py, one per
# feature by design: the package is the name), and the recipe scripts (hftrain/recipes/sft.py, dpo.py, grpo.py), which
# are the commands' public module paths (`-m hftrain.recipes.sft`) beside the methods they run (hftrain/methods/).
SHARED_NAMES = {"__init__", "mixin"}


def test_no_two_modules_share_a_name():
    by_name: dict[str, list[str]] = {}
    for path in SOURCES:
        rel = os.path.relpath(path, PACKAGE)
        if not rel.startswith("recipes" + os.sep):
            by_name.setdefault(os.path.splitext(os.path.basename(path))[0], []).append(rel)
    assert {n: p for n, p in by_name.items() if len(p) > 1 and n not in SHARED_NAMES} == {}


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "recipes", "*.py"))))
def test_recipe_scripts_read_as_a_table_of_contents(path):
    n = sum(1 for _ in open(path, encoding="utf-8"))
    assert n <= 150, f"{path} has {n} lines"


def test_the_installed_versions_are_the_tested_ones():
    """constraints.txt names the versions the suite passes with; scripts/setup.sh installs them (HFTRAIN_NEWEST=1
    installs the newest releases instead: then this is only reported)."""
    from importlib.metadata import PackageNotFoundError, version

    pinned = {}
    with open(os.path.join(REPO, "constraints.txt"), encoding="utf-8") as fh:
        for line in fh:
            line = line.split("#", 1)[0].strip()
            if line:
                name, _, want = line.partition("==")
                pinned[name] = want
    got = {}
    for name in pinned:
        try:
            got[name] = version(name).split("+")[0]
        except PackageNotFoundError:
            got[name] = None
    differ = {n: (pinned[n], got[n]) for n in pinned if got[n] != pinned[n]}
    if os.environ.get("HFTRAIN_NEWEST") == "1":
        pytest.skip(f"HFTRAIN_NEWEST=1: testing other versions than constraints.txt: {differ}")
    assert differ == {}, f"installed versions differ from constraints.txt (name: (tested, installed)): {differ}"


# A method lives in hftrain/methods/ (its section, rules, trainer, data, card): the rest of hftrain asks the registry
# and the sections (config.MethodSection) instead of naming one. What may still name a method: the commands' entry
# points (hftrain/recipes/<script>.py) and the example command written into every generated accelerate config.
# The words: every registered method's name and section (methods/registry.py), and the losses that name no method of
# their own (IPO runs as DPO).
# A model's role (heads.Role: policy, reference, teacher, reward) is a word of the house, not a method's name, though
# the `reward:` section is named after it: GRPO's rewards and the reward role are named outside methods/.
METHOD_WORDS = ({w for e in METHODS for w in (e.name, e.section) if w} | {"ipo"}) - {r.value for r in Role}
MAY_NAME_A_METHOD = {f"recipes/{script}.py" for script in SCRIPTS} | {"launch/strategies.py"}


def _words(text: str):
    for part in re.split(r"[^A-Za-z0-9]+", text):  # snake_case, dotted paths and messages; then CamelCase
        yield from (w.lower() for w in re.findall(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+", part))


def methods_named(source: str) -> set[str]:
    """The methods a module names in its code: identifiers, attributes, imports and strings (docstrings aside)."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    texts = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            texts.append(node.value)
        elif isinstance(node, ast.ImportFrom):
            texts.append(node.module or "")
        else:
            texts += [getattr(node, a) for a in ("id", "attr", "name", "arg")
                      if isinstance(getattr(node, a, None), str)]
    return {w for text in texts for w in _words(text)} & METHOD_WORDS


def test_only_the_methods_name_a_method():
    naming = {}
    for path in SOURCES:
        rel = os.path.relpath(path, PACKAGE).replace(os.sep, "/")
        found = methods_named(open(path, encoding="utf-8").read())
        if found and not rel.startswith("methods/"):
            naming[rel] = sorted(found)
    assert set(naming) <= MAY_NAME_A_METHOD, {k: v for k, v in naming.items() if k not in MAY_NAME_A_METHOD}


def test_the_method_check_sees_a_module_that_names_one(tmp_path):
    source = ('"""About sft, in a docstring: not counted."""\nfrom .methods.grpo_section import GrpoSection\n'
              'def f(recipe):\n    return recipe.preference is not None or "hftrain dpo" or KTOTrainer\n')
    assert methods_named(source) == {"grpo", "preference", "dpo", "kto"}
    assert methods_named('"""sft"""\nx = "supervised"\n') == set()


# A model's head (causal LM, sequence or token classification, image-text-to-text) is declared by its method
# (methods.Method.models) and known by hftrain/heads.py (its Auto class, pipeline tag, card snippet, whether it
# generates): the rest of hftrain asks the head instead of assuming a causal LM.
CAUSAL_LM_NAMES = re.compile(r"ForCausalLM|text-generation")
MAY_ASSUME_A_HEAD = {"heads.py"}


def causal_lm_assumed(source: str) -> set[str]:
    """The causal-LM names a module uses in its code (a ...ForCausalLM class, the text-generation pipeline tag):
    identifiers, attributes, imports and strings (docstrings aside, as methods_named)."""
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    texts = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            texts.append(node.value)
        else:
            texts += [getattr(node, a) for a in ("id", "attr", "name", "module")
                      if isinstance(getattr(node, a, None), str)]
    return {m for text in texts for m in CAUSAL_LM_NAMES.findall(text)}


def test_no_module_outside_the_methods_assumes_a_causal_lm():
    assuming = {}
    for path in SOURCES:
        rel = os.path.relpath(path, PACKAGE).replace(os.sep, "/")
        found = causal_lm_assumed(open(path, encoding="utf-8").read())
        if found and not rel.startswith("methods/") and rel not in MAY_ASSUME_A_HEAD:
            assuming[rel] = sorted(found)
    assert assuming == {}


def test_the_causal_lm_check_sees_a_module_that_assumes_one():
    source = ('"""Loads with AutoModelForCausalLM, in a docstring: not counted."""\n'
              'from transformers import AutoModelForCausalLM\n'
              'def f(path):\n    return transformers.AutoPeftModelForCausalLM, {"pipeline_tag": "text-generation"}\n')
    assert causal_lm_assumed(source) == {"ForCausalLM", "text-generation"}
    assert causal_lm_assumed('"""AutoModelForCausalLM"""\nx = Head.CAUSAL_LM.auto_class\n') == set()


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_each_registered_script_has_its_two_command_paths_and_nothing_else(script):
    """A built-in method's commands are the registry's: `-m hftrain.recipes.<script>` (the package's, after a pip
    install) is `entry(<script>)` and nothing more, and the repository's recipes/<script>.py runs that module. Both
    are kept as files because they are public command paths (`accelerate launch recipes/sft.py ...`); what they run
    is the registry's entry, so a shim cannot drift from its method (a plugin runs as `-m hftrain.recipes SCRIPT`)."""
    package = ast.parse(open(os.path.join(PACKAGE, "recipes", f"{script}.py"), encoding="utf-8").read())
    code = [node for node in package.body if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
    assert [ast.unparse(node) for node in code] == [
        "from hftrain.recipes import entry", f"main = entry({script!r})", "if __name__ == '__main__':\n    main()"]
    repo = ast.parse(open(os.path.join(REPO, "recipes", f"{script}.py"), encoding="utf-8").read())
    code = [node for node in repo.body if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
    assert [ast.unparse(node) for node in code] == [
        f"from hftrain.recipes.{script} import main", "if __name__ == '__main__':\n    main()"]
