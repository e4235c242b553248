"""The code's map stays true: imports follow the documented flow without cycles, the torch-free folders load no
torch, the README's map names every module, every file path or `adapter.` name the README, docs/, docstrings and
comments give exists and none of them names an issue number; test modules share code only through tests/helpers/.

The flow (README, "Layout of the code"): config -> parallel -> models (torch-free facts) -> kernels / modeling (the
torch model) -> data -> convert -> train; plan reads only config, parallel and models. `errors` and `osutil` are
for everyone; patches/ (library internals) for the torch side.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "adapter"
BASE = {"errors", "osutil", "__init__"}
# package (or top-level module) -> the packages it may import besides itself and BASE
FLOW: dict[str, set[str]] = {
    "config": set(),
    "parallel": {"config"},
    "models": {"config", "parallel"},
    "patches": set(),
    "kernels": {"config", "models", "patches"},
    "modeling": {"config", "parallel", "models", "kernels", "patches"},
    "data": {"config", "models"},
    "convert": {"config", "models", "kernels", "modeling", "patches"},
    "plan": {"config", "parallel", "models"},
    "train": {"config", "parallel", "models", "kernels", "modeling", "patches", "data", "convert"},
    "demo": set(),
    "cli": {"config", "models", "convert", "data", "plan", "train"},
    "__main__": {"cli"},
}
# Modules that must load without torch: what `plan`, `--help` and the config checks before `train` import.
TORCH_FREE = ["adapter.cli", "adapter.parallel.layout", "adapter.parallel.deepspeed_config",
              "adapter.parallel.mcore_call", "adapter.train.preflight", "adapter.train.spawn"] + \
    [f"adapter.{d}.{p.stem}" for d in ("config", "models", "plan") for p in sorted((PKG / d).glob("*.py"))
     if p.stem != "__init__"]
HEAVY = ("torch", "megatron", "deepspeed", "transformers", "datasets", "pyarrow", "triton")


def modules(root: Path = PKG) -> dict[str, Path]:
    out = {}
    for p in root.rglob("*.py"):
        parts = p.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _runtime_imports(tree: ast.AST):
    """Import nodes, without those under `if TYPE_CHECKING:` (no runtime arrow)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skip]


def import_graph(root: Path = PKG) -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its body (an import inside a function is an arrow too)."""
    mods = modules(root)

    def resolve(name: str) -> str | None:
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in mods:
                return ".".join(parts[:i])
        return None

    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        edges = set()
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from this package
                    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
                # `from pkg import x`: the module pkg.x when there is one, else pkg (its __init__ hands x on)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                r = resolve(t) if t.startswith(root.name) else None
                if r and r != name:
                    edges.add(r)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def against_flow(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in sorted(graph.items()):
        a = _area(src)
        for t in sorted(targets):
            b = _area(t)
            if b != a and b not in BASE and b not in FLOW.get(a, set()):
                bad.append(f"{src} -> {t}")
    return bad


def test_import_graph_has_no_cycles():
    assert cycles(import_graph()) == []


def test_imports_follow_the_documented_flow():
    assert against_flow(import_graph()) == []
    assert set(FLOW) | BASE >= {_area(m) for m in modules()}, "a new folder needs its place in FLOW and the README"


def test_the_checks_catch_a_cycle_and_an_arrow_up(tmp_path):
    pkg = tmp_path / "adapter"
    for rel, text in {"__init__.py": "", "models/__init__.py": "", "config/__init__.py": "",
                      "models/a.py": "def f():\n    from adapter.models import b\n",
                      "models/b.py": "from adapter.models.a import f\n",
                      "config/c.py": "from adapter.models import a\n"}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    graph = import_graph(pkg)
    assert cycles(graph) == [["adapter.models.a", "adapter.models.b"]]
    assert against_flow(graph) == ["adapter.config.c -> adapter.models.a"]


def test_torch_free_modules_load_no_torch_and_plan_runs_without_it():
    code = (f"import sys, io, contextlib\nfor m in {TORCH_FREE!r}:\n    __import__(m)\n"
            "from adapter.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert main(['plan', 'configs/llama-3.1-8b-hsdp-tp.yaml', '--nodes', '2', '--gpus-per-node', "
            "'8']) == 0\n"
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ---- the README's code map names every module --------------------------------------------------------------------

def code_map(readme: str) -> dict[str, str]:
    """Folder of adapter/ ("" for the package itself, "data/sft" for a subfolder) -> the text of its entry in the
    README's "Layout of the code" block. A folder's entry starts at its name followed by spaces (`─► config/    ...`,
    `plan/          ...`) and runs on over the indented lines below it; a line at the margin that names no folder
    (`cli.py, ...`) is the package's own; inside an entry, `sft/: ...` starts the subfolder's, to the entry's end."""
    block = readme.split("## Layout of the code", 1)[1].split("```", 2)[1]
    entries: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        m = re.match(r"\s*(?:─►\s*)?([a-z_]+)/\s{2,}", line)
        if m:
            current = m.group(1)
            entries[current] = line[m.end():]
        elif line and not line[0].isspace():
            current = ""
            entries[""] = entries.get("", "") + "\n" + line
        elif current is not None:
            entries[current] += "\n" + line
    for folder, text in list(entries.items()):
        for sub in re.finditer(r"(?<![\w/])([a-z_]+)/:", text):
            entries[f"{folder}/{sub.group(1)}".strip("/")] = text[sub.end():]
    return entries


def unmapped_modules(readme: str, pkg: Path = PKG) -> list[str]:
    """The modules of `pkg` whose file stem does not appear in their folder's entry of the code map."""
    entries = code_map(readme)
    missing = []
    for p in sorted(pkg.rglob("*.py")):
        folder = p.parent.relative_to(pkg).as_posix()
        text = entries.get("" if folder == "." else folder)
        if p.stem != "__init__" and (text is None or not re.search(rf"(?<!\w){re.escape(p.stem)}(?!\w)", text)):
            missing.append(p.relative_to(pkg.parent).as_posix())
    return missing


def test_the_readme_code_map_names_every_module():
    assert unmapped_modules((ROOT / "README.md").read_text()) == [], \
        "name the module in its folder's entry of the README's \"Layout of the code\""


def test_the_code_map_check_catches_a_missing_module(tmp_path):
    readme = ("# x\n\n## Layout of the code\n\n```\nYAML\n ─► config/    schema.py (RunConfig), load.py\n"
              "               (paths), hub.py\n ─► data/      documents ─► sampler;\n"
              "               sft/: sources ─► bins\nplan/          build.py + profiles/: reads config/\n"
              "cli.py, errors.py\n```\n\nTests: timing.py\n")
    for rel in ("__init__.py", "cli.py", "errors.py", "osutil.py", "config/__init__.py", "config/schema.py",
                "config/load.py", "config/hub.py", "config/axolotl.py", "data/documents.py", "data/sampler.py",
                "data/sft/__init__.py", "data/sft/sources.py", "data/sft/bins.py", "data/sft/report.py",
                "plan/build.py", "plan/timing.py", "demo/run.py"):
        (tmp_path / "adapter" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "adapter" / rel).write_text("")
    assert unmapped_modules(readme, tmp_path / "adapter") == [
        "adapter/config/axolotl.py", "adapter/data/sft/report.py", "adapter/demo/run.py", "adapter/osutil.py",
        "adapter/plan/timing.py"]


# ---- no issue numbers: a reader of the repository cannot look them up --------------------------------------------

ISSUE = re.compile(r"(?<![\w-])[Ii]ssues?[ -]#?\d+(?!\w)")


def _notes():
    """(where, text) of what explains the code to a reader: _texts() (README, docs/ but the dated log, docstrings and
    comments), the other Markdown files, and the comments of the shipped YAML configs (not tests/fixtures/: those
    are Axolotl's files, copied unchanged)."""
    yield from _texts()
    for top in ("adapter", "bench", "configs", "launch", "tests"):
        for p in sorted((ROOT / top).rglob("*.md")):
            yield str(p.relative_to(ROOT)), p.read_text()
    for top in ("configs", "bench"):
        for p in sorted((ROOT / top).rglob("*.y*ml")):
            yield str(p.relative_to(ROOT)), "\n".join(line.split("#", 1)[1] for line in p.read_text().splitlines()
                                                      if "#" in line)


def issue_numbers(notes) -> list[str]:
    """Every "issue N" (or "issues N", "issue-N", "issue #N") in the (where, text) pairs."""
    return [f"{where}: {m.group(0)}" for where, text in notes for m in ISSUE.finditer(text)]


def test_no_comment_or_doc_names_an_issue_number():
    assert issue_numbers(_notes()) == [], \
        "say the reason, or point to a docs/BENCHMARKS.md entry by its date and heading, instead of the issue number"


def test_the_issue_check_catches_an_issue_number():
    notes = [("a.py", "fixed in issue 19; see Issue-6 and issues 27, 28"), ("b.md", "tracked as issue #4."),
             ("c.py", "plain TP issues 3x fewer collectives; the issue's target; tissue 5; nccl-tests#212")]
    assert issue_numbers(notes) == ["a.py: issue 19", "a.py: Issue-6", "a.py: issues 27", "b.md: issue #4"]


# ---- tests share code only through tests/helpers/ ----------------------------------------------------------------

def foreign_test_imports(tests: Path = ROOT / "tests") -> list[str]:
    """Imports, anywhere in a file under `tests` (a test module, a conftest, a helper), of a `tests.` module outside
    tests.helpers: one test module reading another's helpers or fixtures, or a conftest's names."""
    bad = []
    for p in sorted(tests.rglob("*.py")):
        pkg = list(p.relative_to(tests.parent).parent.parts)
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(pkg[:len(pkg) - node.level + 1] + [node.module or ""]).strip(".") if node.level \
                    else node.module or ""
                names = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                if name.split(".")[0] == tests.name and name.split(".")[1:2] != ["helpers"]:
                    bad.append(f"{p.relative_to(tests.parent)}:{node.lineno}: {name}")
    return bad


def test_tests_import_shared_code_only_from_helpers():
    assert foreign_test_imports() == [], "move what test modules share into tests/helpers/ (fixtures: a conftest.py)"


def test_the_test_import_check_catches_a_test_module_imported(tmp_path):
    tests = tmp_path / "tests"
    for rel, text in {"__init__.py": "", "conftest.py": "", "helpers/__init__.py": "", "helpers/x.py": "",
                      "unit/__init__.py": "", "unit/test_b.py": "def run():\n    pass\n",
                      "unit/test_a.py": ("from tests.helpers.x import y\nfrom tests.helpers import x\n"
                                         "from tests.unit.test_b import run\nfrom .test_b import run\n"
                                         "from ..helpers import x\n"),
                      "gpu/test_c.py": "def f():\n    from tests.conftest import KEY\n    import tests.unit.test_b\n"
                      }.items():
        (tests / rel).parent.mkdir(parents=True, exist_ok=True)
        (tests / rel).write_text(text)
    assert foreign_test_imports(tests) == ["tests/gpu/test_c.py:2: tests.conftest.KEY",
                                           "tests/gpu/test_c.py:3: tests.unit.test_b",
                                           "tests/unit/test_a.py:3: tests.unit.test_b.run",
                                           "tests/unit/test_a.py:4: tests.unit.test_b.run"]


# ---- named paths -------------------------------------------------------------------------------------------------

TOP = ("adapter", "tests", "docs", "bench", "configs", "launch", ".ci")
AREAS = tuple(sorted(set(FLOW) - {"cli", "__main__"}))
PATH = re.compile(r"(?<![\w/.\-])(?:\.\./[\w./\-]+|(?:" + "|".join(re.escape(t) for t in TOP) +
                  r")/[\w./\-{},*]*|(?:" + "|".join(AREAS) + r")/[\w/\-]+\.py)")
DOTTED = re.compile(r"(?<![\w.])adapter(?:\.[A-Za-z_]\w*)+")
BARE = re.compile(r"(?<![\w/.\-])[A-Za-z_]\w*\.py\b")  # a file named alone: some file of the repository has the name
# A dated benchmark log keeps the paths of its date; generated schemas name none.
SKIP_DOCS = {"BENCHMARKS.md"}


def _expand(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [q for alt in m.group(1).split(",") for q in _expand(path[:m.start()] + alt + path[m.end():])]


def _exists(path: str) -> bool:
    """A file or directory of the repository; `dir/module` and `dir/module.name` (a name it defines) count too."""
    path = path.rstrip(".,:;)")
    if path.startswith("../"):
        return False  # outside the repository: a clone does not have it
    if not path.startswith(TOP):
        path = "adapter/" + path
    for p in _expand(path):
        if "*" in p:
            if not any(ROOT.glob(p)):
                return False
            continue
        stem, _, attr = p.rpartition(".")
        if not ((ROOT / p).exists() or (ROOT / f"{p}.py").is_file()
                or ((ROOT / f"{stem}.py").is_file() and _defines(ROOT / f"{stem}.py", attr))):
            return False
    return True


def _defines(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(name in {n.id for n in ast.walk(t) if isinstance(n, ast.Name)} for t in targets):
                return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and name in {(a.asname or a.name).split(".")[0]
                                                                       for a in node.names}:
            return True
        if isinstance(node, ast.If | ast.Try):
            if any(_defines_in(n, name) for n in ast.walk(node)):
                return True
    return False


def _defines_in(node, name) -> bool:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
        return True
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return name in {(a.asname or a.name).split(".")[0] for a in node.names}
    return isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)


def _dotted_exists(ref: str, mods: dict[str, Path]) -> bool:
    parts = ref.split(".")
    for i in range(len(parts), 0, -1):
        mod = ".".join(parts[:i])
        if mod in mods:
            return i == len(parts) or _defines(mods[mod], parts[i]) or mod + "." + parts[i] in mods
    return False


def _texts():
    """(where, text): README, docs/ (but the dated log), and every docstring and comment of the code and tests."""
    yield "README.md", (ROOT / "README.md").read_text()
    for p in sorted((ROOT / "docs").glob("*.md")):
        if p.name not in SKIP_DOCS:
            yield str(p.relative_to(ROOT)), p.read_text()
    for top in ("adapter", "tests", "bench", "launch"):
        for p in sorted((ROOT / top).rglob("*.py")):
            text = p.read_text()
            tree = ast.parse(text)
            docs = [ast.get_docstring(n, clean=False) or "" for n in ast.walk(tree)
                    if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
            comments = [line.split("#", 1)[1] for line in text.splitlines() if "#" in line]
            yield str(p.relative_to(ROOT)), "\n".join(docs + comments)


def dead_in(text: str, mods: dict[str, Path], names: set[str]) -> list[str]:
    """The paths, `adapter.` names and bare file names in `text` that do not exist."""
    return ([m.group(0).rstrip(".,:;)") for m in PATH.finditer(text) if not _exists(m.group(0))]
            + [m.group(0) for m in DOTTED.finditer(text) if not _dotted_exists(m.group(0), mods)]
            + [m.group(0) for m in BARE.finditer(text) if m.group(0) not in names])


def dead_references() -> list[str]:
    mods = modules()
    names = {p.name for top in TOP for p in (ROOT / top).rglob("*.py")}
    return [f"{where}: {ref}" for where, text in _texts() for ref in dead_in(text, mods, names)]


def test_every_named_path_and_module_exists():
    assert dead_references() == []


def test_the_path_check_catches_a_dead_path():
    text = ("adapter/models/gpt.py, adapter/modeling/gpt.py, ../shared/NOTES.md, bench/configs/llama-3.2-{1b,3b}-1gpu."
            "yaml, adapter/models/source.resolve, models/checks.py, adapter.models.counts.flops_per_token, "
            "adapter.train.metrics.flops_per_token_for, ops.py, trainer.py")
    names = {"gpt.py", "trainer.py"}
    assert dead_in(text, modules(), names) == ["adapter/models/gpt.py", "../shared/NOTES.md",
                                               "adapter.train.metrics.flops_per_token_for", "ops.py"]


MAX_LINES = 500  # a module a reader takes in at once; past it, a module holds more than one concern


def test_no_module_is_longer_than_a_reader_takes_in():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in modules().values()}
    long = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert long == {}, f"split these by concern (at most {MAX_LINES} lines each)"
