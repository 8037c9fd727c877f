"""A clean house: no import circles, an explicit public API, no dead layout code, and comments and
docs that name files which exist and describe the tree as it is."""

import ast
import io
import json
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
import torch

from megamoe import reference as ref
from megamoe.reference import MegaMoEInputError

ROOT = Path(__file__).resolve().parents[1]
# The import package's folders (pyproject's package-dir): megamoe.reference is reference/, ...
PACKAGES = {
    "megamoe": ROOT / "megamoe",
    "megamoe.reference": ROOT / "reference",
    "megamoe.conformance": ROOT / "conformance",
    "megamoe.kernel": ROOT / "kernel",
}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            mods[".".join([pkg, *parts])] = path
    return mods


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module of ours that `name` imports, at any depth of the file: function-local and
    TYPE_CHECKING imports count too, because they are how a circle gets hidden."""
    is_pkg = path.name == "__init__.py"
    base = name if is_pkg else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                mod = ".".join(anchor + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):  # a module's own package is no edge
                out.add(t)
    return out


def test_the_reference_package_has_no_import_circle():
    mods = _modules()
    graph = {n: _imports(n, p, set(mods)) for n, p in mods.items() if n.startswith("megamoe.reference.")}
    graph = {n: {m for m in deps if m in graph} for n, deps in graph.items()}
    state: dict[str, int] = {}

    def visit(n, stack):
        state[n] = 1
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                cycle = stack[stack.index(m) :] + [m]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if m not in state:
                visit(m, stack + [m])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])


# The folders' layers, lowest first; a module may import its own layer and those it lists. A DAG:
# the reference judges everything, so it depends on nothing of ours; the dump format is shared by
# the checkers, which judge a dump with no GPU, nvcc or runtime, and the runtime, whose debug path
# makes dumps without the checkers; the tools (CLI, report, probes) use all of the library; the
# benchmarks use anything and are imported by nothing of the library.
LAYERS = {
    "reference": (),
    "dump format": ("reference",),
    "checkers": ("reference", "dump format"),
    "runtime": ("reference", "dump format"),
    "tools": ("reference", "dump format", "checkers", "runtime"),
    "bench": ("reference", "dump format", "checkers", "runtime", "tools"),
}
DUMP_FORMAT = {"megamoe.conformance", "megamoe.conformance.dump"}  # the package's __init__ is lazy
RUNTIME = (
    "megamoe.moe",
    "megamoe.gemm",
    "megamoe.runtime",
    "megamoe.heuristics",
    "megamoe.launch",
    "megamoe.launchers",
    "megamoe.ops",
    "megamoe.ranks",
    "megamoe.multirank",
    "megamoe.timeline",
    "megamoe.jit",
)


def _layer(name: str) -> str:
    def under(*prefixes: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in prefixes)

    if under("megamoe.reference"):
        return "reference"
    if name in DUMP_FORMAT:
        return "dump format"
    if under("megamoe.conformance"):
        return "checkers"
    if under(*RUNTIME, "megamoe.kernel"):
        return "runtime"
    if under("bench"):
        return "bench"
    return "tools"  # every other module of megamoe/: the CLI, the report, the probes, ...


def test_the_folders_import_each_other_as_a_dag():
    mods = _modules()
    mods.update({f"bench.{p.stem}" if p.stem != "__init__" else "bench": p for p in (ROOT / "bench").glob("*.py")})
    # The package root is the namespace every module's import passes through: it must import none
    # of them (its names are imported on first use), so that it adds no edge.
    assert _imports("megamoe", mods["megamoe"], set(mods)) == set()
    del mods["megamoe"]
    layers = list(LAYERS)
    for layer, below in LAYERS.items():  # each layer lists only layers under it: no circle
        assert all(layers.index(b) < layers.index(layer) for b in below), layer
    bad = []
    for name, path in sorted(mods.items()):
        allowed = {_layer(name), *LAYERS[_layer(name)]}
        for dep in sorted(_imports(name, path, set(mods))):
            if _layer(dep) not in allowed:
                bad.append(f"{name} ({_layer(name)}) imports {dep} ({_layer(dep)})")
    assert not bad, "\n".join(bad)


def test_the_dag_test_sees_the_edges_it_forbids():
    # The layering above is only as good as its edges: a function-local import counts.
    mods = _modules()
    assert "megamoe.conformance.dump" in _imports("megamoe.moe", mods["megamoe.moe"], set(mods))
    assert _layer("megamoe.conformance.suite") == "checkers" and _layer("megamoe.jit.contract") == "runtime"
    assert _layer("megamoe.reference.threads") == "reference" and _layer("megamoe.cli") == "tools"


def test_the_input_error_has_its_own_module_and_is_caught_as_type_or_value_error():
    from megamoe.reference.errors import MegaMoEInputError as from_errors

    assert from_errors is MegaMoEInputError
    assert issubclass(MegaMoEInputError, TypeError) and issubclass(MegaMoEInputError, ValueError)
    for caught in (TypeError, ValueError):
        with pytest.raises(caught, match="argument 'hidden'"):
            ref.MoEConfig(hidden=100, intermediate=128, num_experts=2, top_k=1)


def test_the_config_checks_itself_in_its_own_module():
    from megamoe.reference import config

    assert config.check_config.__module__ == "megamoe.reference.config"


def _literal_all(path: Path) -> list[str]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            value = ast.literal_eval(node.value)  # raises if __all__ is computed
            assert isinstance(value, list)
            return value
    pytest.fail(f"{path} has no __all__")


def test_the_reference_api_is_an_explicit_list_of_what_it_imports():
    path = ROOT / "reference" / "__init__.py"
    names = _literal_all(path)
    assert len(names) == len(set(names)), "a name listed twice"
    imported = {
        a.asname or a.name
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.ImportFrom)
        for a in node.names
    }
    public = {n for n in imported if not n.startswith("_")}
    assert set(names) == public, (sorted(public - set(names)), sorted(set(names) - public))
    assert all(hasattr(ref, n) for n in names)


def test_the_reference_has_no_second_kernel_weight_layout():
    # The kernel's layout is megamoe.jit.layout.transform_weights; a half-layout in the reference
    # that the kernel never consumed only misled its readers.
    for name in ("InterleavedWeights", "interleave_weights", "deinterleave_weights"):
        assert not hasattr(ref, name), name
        assert not hasattr(ref.weights, name), name


def test_random_weights_have_the_documented_spread_in_every_row():
    doc = ref.random_weights.__doc__
    assert "std 1/sqrt(fan_in)" in doc and "per-row spread" not in doc
    w = ref.random_weights(2, 256, 128, seed=0)
    w1 = ref.dequantize_fp4(w.w1, w.w1_sf)  # [E, 2I, H]: fan_in H
    std = w1.double().std(dim=-1)
    assert torch.allclose(std, torch.full_like(std, 256**-0.5), rtol=0.25)


# Paths in comments: "kernel/epilogue/silu.cuh", "megamoe/jit/flags.py", "../epilogue/silu.cuh".
PATH_RE = re.compile(r"(?<![\w./-])((?:\.\./|[\w-]+/)+[\w.-]+\.(?:py|cu|cuh|h|md|bin|sh|toml|txt|json|in))\b")
SOURCES = ("*.py", "*.cu", "*.cuh", "*.md", "*.sh", "*.in")


def _repo_files() -> list[Path]:
    skip = {".venv", ".git", "build", "dist", "__pycache__", ".pytest_cache", ".hypothesis"}
    out = []
    for pattern in SOURCES:
        out += [
            p
            for p in ROOT.rglob(pattern)
            if not skip & set(p.relative_to(ROOT).parts) and not any(part.endswith(".egg-info") for part in p.parts)
        ]
    return sorted(set(out))


def _exists(mention: str, where: Path) -> bool:
    # From the repository root, from the naming file's folder, or from kernel/ (the JIT's include
    # root, whose sources are named as "gemm/gemm_sm90.cuh").
    candidates = [ROOT / mention, where.parent / mention, ROOT / "kernel" / mention]
    head, _, rest = mention.partition("/")
    if head == "megamoe" and rest.split("/")[0] in ("reference", "conformance", "kernel"):
        candidates.append(ROOT / rest)  # megamoe/reference/x.py is reference/x.py
    return any(c.exists() for c in candidates)


def _prose(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of what a reader takes as documentation: Markdown, Python comments and
    docstrings, C++ and shell comments, C++ include paths. Code strings are left out: tests write
    files of made-up names."""
    text = path.read_text(errors="replace")
    lines = text.splitlines()
    if path.suffix == ".md":
        return list(enumerate(lines, 1))
    if path.suffix == ".py":
        out = [
            (tok.start[0], tok.string)
            for tok in tokenize.generate_tokens(io.StringIO(text).readline)
            if tok.type == tokenize.COMMENT
        ]
        for node in ast.walk(ast.parse(text)):
            if (
                isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and ast.get_docstring(node, clean=False) is not None
            ):
                doc = node.body[0]
                out += [(n, lines[n - 1]) for n in range(doc.lineno, doc.end_lineno + 1)]
        return out
    marker = "#" if path.suffix == ".sh" else "//"
    out = []
    for n, line in enumerate(lines, 1):
        if marker in line:
            out.append((n, line[line.index(marker) :]))
        elif line.lstrip().startswith("#include"):
            out.append((n, line))
    return out


def test_every_repository_path_named_in_a_comment_or_doc_exists():
    missing = []
    for path in _repo_files():
        if path == Path(__file__).resolve():
            continue  # this file names made-up paths as examples
        for lineno, line in _prose(path):
            for mention in PATH_RE.findall(line):
                if mention.split("/")[0].isupper() or "*" in mention:
                    continue  # a placeholder (OUT_DIR/x.bin) or a glob
                if not _exists(mention, path):
                    missing.append(f"{path.relative_to(ROOT)}:{lineno}: {mention}")
    assert not missing, "\n".join(missing)


STAGE_FILES = ("dispatch", "pool", "l1", "swiglu", "l2", "combine", "cleanup")


def test_folders_the_readme_says_mirror_the_stages_have_one_module_per_stage():
    text = (ROOT / "README.md").read_text()
    claims = re.findall(r"((?:`\w+/`(?:,| and)?\s*)+)mirror\s+each\s+other\s+stage\s+by\s+stage", text)
    assert claims, "the README no longer says which folders mirror the stages"
    for claim in claims:
        for folder in re.findall(r"`(\w+)/`", claim):
            names = {p.stem for p in (ROOT / folder).iterdir()}
            # pool is built in dispatch.py by the reference (build_pool): a module for either counts
            lacking = [s for s in STAGE_FILES if s not in names and not (s == "pool" and "dispatch" in names)]
            assert not lacking, f"README says {folder}/ mirrors the stages, but it has no {lacking}"


def test_mega_moe_input_error_is_the_one_raised_for_bad_config_fields():
    with pytest.raises(MegaMoEInputError, match="argument 'activation_clamp'"):
        ref.MoEConfig(hidden=128, intermediate=128, num_experts=2, top_k=1, activation_clamp=-1.0)


def _fresh_python(code: str) -> subprocess.CompletedProcess:
    """`code` in a new interpreter: what a newcomer's `import megamoe` sees, with nothing that this
    test process (or another test) already imported."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_importing_megamoe_is_cheap_it_imports_neither_torch_nor_any_submodule():
    # `import megamoe` must work without a GPU or nvcc, and cost nothing: the public names are
    # imported on first use (megamoe/__init__.py).
    proc = _fresh_python(
        "import sys, megamoe; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('megamoe.')))"
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_the_public_api_is_a_written_out_list_with_one_docstring_line_per_name():
    import megamoe

    names = _literal_all(ROOT / "megamoe" / "__init__.py")
    assert len(names) == len(set(names)), "a name listed twice"
    documented = [line.split()[0] for line in megamoe.__doc__.splitlines() if line.startswith("    ") and line.strip()]
    assert sorted(documented) == sorted(names), "each name of __all__ needs one line in the module docstring"
    assert set(names) <= set(dir(megamoe))


# A dotted name as the docs write it: megamoe.gemm.l1_gemm, not torch.ops.megamoe.moe_layer (the
# op's namespace) and not a path (megamoe/gemm.py).
DOTTED_NAME_RE = re.compile(r"(?<![\w./-])megamoe(?:\.[A-Za-z_]\w*)+")


def test_every_dotted_megamoe_name_in_the_docs_and_the_public_list_resolves_after_a_bare_import():
    where = {}
    for path in _repo_files():
        for lineno, line in _prose(path):
            for name in DOTTED_NAME_RE.findall(line):
                where.setdefault(name, f"{path.relative_to(ROOT)}:{lineno}")
    for name in _literal_all(ROOT / "megamoe" / "__init__.py"):
        where.setdefault(f"megamoe.{name}", "megamoe/__init__.py __all__")
    # the README's examples; the scan above must keep finding them
    assert {"megamoe.MegaMoE", "megamoe.conformance.suite.check", "megamoe.gemm.prepare_l1_gemm"} <= set(where)
    code = (
        "import json, sys, megamoe\n"
        "bad = []\n"
        "for name in json.load(sys.stdin):\n"
        "    obj = megamoe\n"
        "    try:\n"
        "        for part in name.split('.')[1:]:\n"
        "            obj = getattr(obj, part)\n"
        "    except AttributeError as e:\n"
        "        bad.append(f'{name}: {e}')\n"
        "print(json.dumps(bad))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], input=json.dumps(sorted(where)), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    bad = json.loads(proc.stdout)
    assert not bad, "\n".join(f"{b} (named at {where[b.split(':')[0]]})" for b in bad)
