"""The library's import graph, read from the source with `ast`: no import circle anywhere in ddpo_grpo, the models
layer free of the worlds, and core free of everything above it.

The rule (how the interpreter reads imports):
- every `import` / `from ... import` statement counts, at module level *and inside functions*: a function-local import
  runs when the function is first called, so a circle through one is still a circle, only one found later (at call
  time, often mid-run, as a half-initialised module). Hiding an import in a function does not break a circle.
- imports under `if TYPE_CHECKING:` do not count: the interpreter never runs them (annotations only).
- relative imports are resolved against the importing module's package; `from pkg import name` is an import of the
  submodule pkg.name where that is a module, else of pkg (its __init__).
- a package's __init__ being run before its submodules is the import system's structure, not an edge: only the
  imports written in the code are.
- importlib.import_module and entry points (the model and reward registries, models.BUILDERS) are lookups by name at
  run time, not part of the static graph.
"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "ddpo_grpo"


def module_files(root: str = ROOT, package: str = PACKAGE) -> dict:
    """Dotted module name -> file, for every .py under the package."""
    found = {}
    for folder, _, files in os.walk(os.path.join(root, package)):
        for name in files:
            if name.endswith(".py"):
                parts = os.path.relpath(os.path.join(folder, name), root)[:-3].split(os.sep)
                found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = os.path.join(folder, name)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(name: str, source: str, modules) -> list:
    """[(imported module, line)] of one module's source, by the rule above, within the package only."""
    is_pkg_init = modules.get(name, "").endswith("__init__.py")
    out = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for other in child.orelse:  # the else branch does run
                    visit(ast.Module(body=[other], type_ignores=[]))
                continue
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = name.split(".") if is_pkg_init else name.split(".")[:-1]
                    base = base[:len(base) - (child.level - 1)]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                for a in child.names:
                    out.append((f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod, child.lineno))
            visit(child)

    visit(ast.parse(source))
    edges = []
    for mod, line in out:
        if mod != PACKAGE and not mod.startswith(PACKAGE + "."):
            continue
        while mod not in modules and "." in mod:  # `import ddpo_grpo.x.y` of a name inside x: the module x
            mod = mod.rsplit(".", 1)[0]
        if mod != name:
            edges.append((mod, line))
    return edges


def import_graph(root: str = ROOT, overrides: dict = None) -> dict:
    """module -> [(imported module, line)]; `overrides` (module -> source) replaces a file's text (the tests' own
    circles)."""
    modules = module_files(root)
    graph = {}
    for name, path in modules.items():
        if overrides and name in overrides:
            source = overrides[name]
        else:
            with open(path, encoding="utf-8") as f:
                source = f.read()
        graph[name] = imports_of(name, source, modules)
    return graph


def cycles(graph: dict) -> list:
    """Each import circle once, as [a, b, ..., a] with the line of each arrow: one cycle per strongly connected
    component (Tarjan), the shortest through its first module."""
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w, _ in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(set(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    found = []
    for comp in comps:
        start = min(comp)
        # breadth-first from start back to start inside the component: the shortest circle, readable in a message
        paths, seen = {start: [(start, None)]}, {start}
        queue, circle = [start], None
        while queue and circle is None:
            v = queue.pop(0)
            for w, line in graph[v]:
                if w == start:
                    circle = paths[v] + [(w, line)]
                    break
                if w in comp and w not in seen:
                    seen.add(w)
                    paths[w] = paths[v] + [(w, line)]
                    queue.append(w)
        found.append(circle)
    return found


def describe(circle) -> str:
    """'a -> b (b imported at a.py:12) -> a (...)'."""
    steps = [circle[0][0]]
    for (prev, _), (mod, line) in zip(circle, circle[1:]):
        steps.append(f"{mod} (line {line} of {prev})")
    return " -> ".join(steps)


def reachable(graph: dict, start_prefix: str) -> dict:
    """Every module imported, directly or not, from the modules named start_prefix[.*] -> the chain that reaches it."""
    starts = [m for m in graph if m == start_prefix or m.startswith(start_prefix + ".")]
    chain = {m: [m] for m in starts}
    queue = list(starts)
    while queue:
        v = queue.pop(0)
        for w, _ in graph[v]:
            if w not in chain:
                chain[w] = chain[v] + [w]
                queue.append(w)
    return chain


def under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


# --------------------------------------------------------------------------------------------------------- tests
def test_no_import_circle_in_the_library():
    found = cycles(import_graph())
    assert not found, "import circles (move the shared helper to the module whose idea it is):\n" + "\n".join(
        describe(c) for c in found)


def test_the_graph_sees_a_circle_through_a_function_local_import():
    # The mechanism itself: a circle hidden in a function (LoadedPipeline's default adapter imported models.sd inside
    # __post_init__ before issue 48) is found and named; a TYPE_CHECKING import is not one.
    base = os.path.join(ROOT, PACKAGE, "models", "base.py")
    with open(base, encoding="utf-8") as f:
        text = f.read()
    hidden = text + "\n\ndef _default():\n    from .sd import ADAPTER\n    return ADAPTER\n"
    found = cycles(import_graph(overrides={"ddpo_grpo.models.base": hidden}))
    local_line, sd_line = hidden.count("\n") - 1, _line_of(PACKAGE + "/models/sd.py", "from .base")
    assert [describe(c) for c in found] == [
        f"ddpo_grpo.models.base -> ddpo_grpo.models.sd (line {local_line} of ddpo_grpo.models.base) -> "
        f"ddpo_grpo.models.base (line {sd_line} of ddpo_grpo.models.sd)"]
    typed = text + "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sd import ADAPTER\n"
    assert not cycles(import_graph(overrides={"ddpo_grpo.models.base": typed}))


def _line_of(rel: str, start: str) -> int:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return next(i for i, line in enumerate(f, 1) if line.startswith(start))


def test_models_import_no_world():
    # A model's tokenizer vocabulary comes from the models layer (models/vocabulary.py), not from a world's prompts.
    chain = reachable(import_graph(), "ddpo_grpo.models")
    bad = [" -> ".join(c) for m, c in sorted(chain.items()) if under(m, "ddpo_grpo.worlds")]
    assert not bad, "ddpo_grpo.models imports a world:\n" + "\n".join(bad)


def test_core_imports_nothing_above_it():
    # core is the math (log-probs, statistics, losses): the layers above it import it, never the reverse.
    chain = reachable(import_graph(), "ddpo_grpo.core")
    above = ("ddpo_grpo.models", "ddpo_grpo.worlds", "ddpo_grpo.rewards", "ddpo_grpo.trainer")
    bad = [" -> ".join(c) for m, c in sorted(chain.items()) if any(under(m, p) for p in above)]
    assert not bad, "ddpo_grpo.core imports a layer above it:\n" + "\n".join(bad)
