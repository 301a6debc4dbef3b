"""The package layout: the math in ddpo_grpo.core imports without accelerate; ddpo-pytorch's public paths still
work; `import ddpo_grpo` stays light; the generic rewards package imports no world (worlds are plugins); what
differs between model families lives in ddpo_grpo.core.families alone."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = ("common", "ddim_with_logprob", "sde_with_logprob", "policy_step", "pipeline_with_logprob", "stat_tracking",
        "loss", "reference", "forward_loss", "families", "branching")


def run_py(code: str) -> subprocess.CompletedProcess:
    # DDPO_GRPO_TEST_FORK=0: a fresh interpreter (these runs check what it has imported; the suite's fork server
    # would hand them one with torch and accelerate imported)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), DDPO_GRPO_TEST_FORK="0")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def test_core_imports_without_accelerate():
    # None in sys.modules makes `import accelerate` (and any accelerate.x) raise ImportError.
    code = ("import sys; sys.modules['accelerate'] = None\n"
            + "".join(f"import ddpo_grpo.core.{m}\n" for m in CORE)
            + "import ddpo_grpo.diffusers_patch.ddim_with_logprob, ddpo_grpo.diffusers_patch.pipeline_with_logprob\n"
            + "import ddpo_grpo.stat_tracking\n"
            + "assert not any(m == 'ddpo_grpo.trainer' or m.startswith('ddpo_grpo.trainer.') for m in sys.modules)\n"
            + "print('ok')")
    p = run_py(code)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


def test_public_ddpo_pytorch_names():
    p = run_py(
        "import sys, ddpo_grpo\n"
        "assert 'torch' not in sys.modules and 'accelerate' not in sys.modules  # the package root is light\n"
        "from ddpo_grpo.diffusers_patch.ddim_with_logprob import ddim_step_with_logprob\n"
        "from ddpo_grpo.diffusers_patch.pipeline_with_logprob import pipeline_with_logprob\n"
        "from ddpo_grpo.stat_tracking import PerPromptStatTracker\n"
        "from ddpo_grpo.core import ddim_with_logprob, pipeline_with_logprob as pipe, stat_tracking\n"
        "assert ddim_step_with_logprob is ddim_with_logprob.ddim_step_with_logprob is ddpo_grpo.ddim_step_with_logprob\n"
        "assert pipeline_with_logprob is pipe.pipeline_with_logprob is ddpo_grpo.pipeline_with_logprob\n"
        "assert PerPromptStatTracker is stat_tracking.PerPromptStatTracker is ddpo_grpo.PerPromptStatTracker\n"
        "assert 'accelerate' not in sys.modules\n"
        "print('ok')")
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


def test_rewards_import_no_world_and_find_world_rewards_by_entry_point():
    p = run_py(
        "import sys\n"
        "import ddpo_grpo.rewards as r\n"
        "assert not [m for m in sys.modules if m.startswith('ddpo_grpo.worlds')], 'rewards imported a world'\n"
        "assert {'toyworld', 'cam_score', 'unifiedscore'} <= set(r.available_rewards())\n"
        "from ddpo_grpo.worlds.toyworld.reward import make_toyworld_reward\n"
        "from ddpo_grpo.worlds.recam.cam_score import make_cam_score\n"
        "from ddpo_grpo.worlds.recam.unifiedscore import make_unifiedscore\n"
        "assert r.get_reward_factory('toyworld') is make_toyworld_reward\n"
        "assert r.get_reward_factory('cam_score') is make_cam_score\n"
        "assert r.get_reward_factory('unifiedscore') is make_unifiedscore\n"
        "print('ok')")
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


def test_benchmarks_are_outside_the_library():
    assert not any(f.startswith("bench") for f in os.listdir(os.path.join(ROOT, "ddpo_grpo")))
    import benchmarks.bench_plots  # noqa: F401  (the repo root is on sys.path: tests/conftest.py)


# `family == "flow"`, `pipe.family != 'ddim'`, `"ddim" == name`, `.name == "flow"`: a family decided by comparing names.
FAMILY_COMPARISON = re.compile(r"""family\w*\s*[!=]=|[!=]=\s*[\w.]*family\b|[!=]=\s*["'](ddim|flow)["']|["'](ddim|flow)["']\s*[!=]=""")


def test_family_comparisons_only_in_the_families_module():
    # Call sites ask the family object (core.families.get_family) instead of branching on the family's name, so
    # that a family's behaviour is in one place and a new family is one class.
    assert FAMILY_COMPARISON.search('if settings.family == "flow":') and FAMILY_COMPARISON.search("x = 'ddim' != f")
    assert FAMILY_COMPARISON.search("if fam.name != 'ddim'") and not FAMILY_COMPARISON.search('family = "ddim"')
    found = []
    for top in ("ddpo_grpo", "benchmarks", "scripts"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                path = os.path.join(folder, name)
                if not name.endswith(".py") or path == os.path.join(ROOT, "ddpo_grpo", "core", "families.py"):
                    continue
                with open(path, encoding="utf-8") as f:
                    found += [f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}"
                              for i, line in enumerate(f, 1) if FAMILY_COMPARISON.search(line)]
    assert not found, "family decided by name outside ddpo_grpo/core/families.py:\n" + "\n".join(found)


LAYOUT = os.path.join(ROOT, "docs", "layout.md")
DOCUMENTED = ("ddpo_grpo", "scripts", "benchmarks")  # the folders whose every module docs/layout.md names


def tree_modules() -> list:
    """Every module under DOCUMENTED (and the shell entry points of scripts/ and benchmarks/), as a path from the repository root."""
    found = []
    for top in DOCUMENTED:
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            found += [os.path.relpath(os.path.join(folder, n), ROOT).replace(os.sep, "/")
                      for n in files if n.endswith(".py") or (top in ("scripts", "benchmarks") and n.endswith(".sh"))]
    return sorted(found)


def layout_paths(text: str) -> set:
    """The paths docs/layout.md names in backticks, `folder/.../name.py`, under DOCUMENTED."""
    return {p for p in re.findall(r"`([\w./-]+\.(?:py|sh))`", text) if p.split("/")[0] in DOCUMENTED}


def test_layout_names_every_module_and_no_stale_one():
    # A module nobody can find in the layout is one a newcomer never reads; a path that no longer exists misleads.
    with open(LAYOUT, encoding="utf-8") as f:
        named = layout_paths(f.read())
    modules = tree_modules()
    missing = [m for m in modules if m not in named]
    stale = sorted(named - set(modules))
    assert not missing, ("docs/layout.md does not name (python tests/test_layout.py rewrites 'Every module' from the "
                         "tree): " + ", ".join(missing))
    assert not stale, "docs/layout.md names modules that do not exist: " + ", ".join(stale)
    # the check itself: a module removed from the text is reported
    assert "ddpo_grpo/trainer/epoch/update.py" in modules and "ddpo_grpo/trainer/epoch/update.py" not in layout_paths(
        "| `ddpo_grpo/trainer/epoch/training.py` | ... |")


EVERY_MODULE = "## Every module"
LINE = 200  # a longer first sentence ends at its last semicolon, comma or bracket before


def first_line(path: str) -> str:
    """A module's own first line: its docstring's (a .py), or its first comment's below the shebang (a .sh)."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".py"):
        import ast

        doc = " ".join((ast.get_docstring(ast.parse(text)) or "").strip().split("\n\n")[0].split())
        line = re.split(r"(?<!e\.g\.)(?<!i\.e\.)(?<=\.) ", doc, maxsplit=1)[0].rstrip(".")  # the first sentence
        if len(line) <= LINE:
            return line
        # where a clause ends outside brackets: the last "; " before LINE, else the last ", " or " ("
        ends = [(sep == "; ", m.start()) for sep in ("; ", ", ", " (") for m in re.finditer(re.escape(sep), line[:LINE])
                if line[:m.start()].count("(") == line[:m.start()].count(")")]
        return line[:max(ends)[1]] if ends else line[:line.rindex(" ", 0, LINE)]
    comments = [line[1:].strip() for line in text.splitlines()[1:] if line.startswith("#")]
    return comments[0] if comments else ""


def every_module_section(text: str) -> str:
    """docs/layout.md's "Every module" section from the tree: one table per folder, each module's first line (a row
    already in `text` for a shell script is kept: its description is written by hand)."""
    kept = dict(re.findall(r"^\| `([\w./-]+\.sh)` \| (.*) \|$", text, re.M))
    head = text[text.index(EVERY_MODULE):].split("\n### ", 1)[0].rstrip("\n")
    folders = {}
    for path in tree_modules():
        folders.setdefault(path.rsplit("/", 1)[0] + "/", []).append(path)
    out = [head]
    for top in DOCUMENTED:
        for folder in sorted(f for f in folders if f.split("/")[0] == top):
            rows = sorted(folders[folder], key=lambda p: (p.endswith(".sh"), p))
            out += ["", f"### `{folder}`", "", "| module | what |", "|---|---|"]
            out += [f"| `{p}` | {kept.get(p) or first_line(p).replace('|', '/')} |" for p in rows]
    return "\n".join(out) + "\n"


if __name__ == "__main__":  # python tests/test_layout.py: rewrite docs/layout.md's "Every module" from the tree
    with open(LAYOUT, encoding="utf-8") as f:
        old = f.read()
    new = old[:old.index(EVERY_MODULE)] + every_module_section(old)
    with open(LAYOUT, "w", encoding="utf-8") as f:
        f.write(new)
    print(f"{LAYOUT}: {'rewritten' if new != old else 'unchanged'}")
