"""What the README and `--help` say is what the tool does: examples that are real commands, the policies each
option applies to, the learner path's line count."""
import re
from pathlib import Path

import pytest

from h2o_mini.cli.options import RECENT_HELP
from h2o_mini.policies import REGISTRY

from .test_bad_input import run_cli

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def test_the_readme_examples_are_real_commands():
    """No example feeds a placeholder to the model (`"..."` would be generated from, as written)."""
    examples = [line for line in README.read_text().splitlines() if line.lstrip().startswith("h2o-mini")]
    assert examples and not [line for line in examples if '"..."' in line]


def test_the_readme_names_exactly_the_policies_recent_applies_to():
    text = " ".join(README.read_text().split())
    sentence = text[text.index("`--recent` splits C for"):].split("(`h2o-mini policies` marks them)")[0]
    assert set(re.findall(r"`(\w+)`", sentence)) - {"--recent"} == {n for n, c in REGISTRY.items() if c.takes_recent}


def test_recent_help_names_exactly_the_policies_it_applies_to():
    named = set(re.findall(r"[a-z_0-9]+", RECENT_HELP.split(" (and")[0].split("for ", 1)[1]))
    assert named == {name for name, cls in REGISTRY.items() if cls.takes_recent}


@pytest.mark.parametrize("command", ["ppl", "tasks"])
def test_single_policy_commands_do_not_call_it_repeatable(command, capsys, monkeypatch):
    code, out, _ = run_cli(capsys, monkeypatch, "eval", command, "--help")
    assert code == 0
    policy_help = out[out.index("--policy"):out.index("--recent")]
    assert "repeatable" not in policy_help and f"eval sweep {command}" in " ".join(policy_help.split())


def test_the_learner_paths_line_count_is_true():
    """"in three files and N lines (`wc -l`)": N is the three linked files' lines as they are now."""
    text = README.read_text()
    claimed = int(re.search(r"in three files and (\d+) lines", text).group(1))
    section = text[text.index("## Read the algorithm"):]
    files = re.findall(r"^\d\. \[`([^`]+)`\]", section, re.M)[:3]
    assert len(files) == 3 and claimed == sum(len((ROOT / f).read_text().splitlines()) for f in files), files


CORE = ["config.py", "config_readers.py", "model.py", "cache.py", "prompt.py", "wavefront.py", "quant.py",
        "generate.py", "parallel.py", "tokenizer.py", "files.py", "errors.py", "weights", "policies"]
BESIDE = {"checks", "views", "evals", "cli", "transformers_cache", "transformers_engine"}


def test_the_core_imports_nothing_from_beside_it():
    """The README's layout: the core (the files and folders of CORE) imports nothing from checks/, views/,
    evals/, cli/ or the transformers extra, at the top of a module or inside a function."""
    import ast
    package = ROOT / "h2o_mini"
    files = [p for name in CORE for p in ([package / name] if name.endswith(".py") else (package / name).rglob("*.py"))]
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                parts = set(name.replace("h2o_mini.", "").split("."))
                if parts & BESIDE:
                    found.append(f"{path.relative_to(ROOT)}: {name}")
    assert len(files) > 20 and not found, found
