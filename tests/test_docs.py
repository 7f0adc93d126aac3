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


def test_every_file_the_docs_name_under_scripts_or_results_is_there():
    """A path `scripts/...` or `results/...` with a file's suffix, named in the README, docs/, scripts/ or the
    package's docstrings, is a file of the repository (results/ and scripts/ are in folders by subject: a
    reader following a citation finds the file). Paths built from a variable (`$out/...`) are not citations."""
    pattern = re.compile(r"(?<![\w/.$-])((?:scripts|results)/[\w./-]+\.(?:jsonl|png|md|txt|safetensors|py|sh))")
    sources = [README, *(ROOT / "docs").rglob("*.md"), *(ROOT / "scripts").rglob("*.*"),
               *(ROOT / "results").glob("*.md"), *(ROOT / "h2o_mini").rglob("*.py")]
    named = {(m, s.relative_to(ROOT)) for s in sources if s.suffix in {".md", ".py", ".sh"}
             for m in pattern.findall(s.read_text())}
    missing = sorted(f"{source}: {path}" for path, source in named if not (ROOT / path).is_file())
    assert len(named) > 50 and not missing, missing


@pytest.mark.parametrize("folder", ["scripts", "results"])
def test_every_subject_folder_has_its_line_in_the_folders_readme(folder):
    """scripts/ and results/ hold folders by subject, no loose files but their README, and the README gives each
    folder a line of its own."""
    readme = (ROOT / folder / "README.md").read_text()
    loose = [p.name for p in (ROOT / folder).iterdir() if p.is_file() and p.name != "README.md"]
    unnamed = [p.name for p in (ROOT / folder).iterdir()
               if p.is_dir() and not p.name.startswith(("_", ".")) and f"- `{p.name}/`" not in readme]
    assert not loose and not unnamed, (loose, unnamed)
