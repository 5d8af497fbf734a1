"""The README's promises stay true: CI runs its test command; the demo passes."""
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _readme_commands():
    return re.findall(r"^(bash scripts/setup\.sh && python3 -m \S+.*)$", (ROOT / "README.md").read_text(), re.M)


def test_readme_starts_with_demo_and_test_commands_and_ci_runs_the_test_one():
    cmds = _readme_commands()
    assert cmds[:2] == ["bash scripts/setup.sh && python3 -m torch_xaccel.demo",
                        "bash scripts/setup.sh && python3 -m pytest -q -n auto --maxprocesses 4"], cmds
    assert cmds[1] in (ROOT / ".ci" / "run").read_text()


def test_readme_is_one_screen_deep_and_opens_with_its_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, len(lines)
    top = lines[:15]
    assert all(cmd in top for cmd in _readme_commands()[:2]), top


def test_links_of_readme_and_docs_resolve():
    """Every relative link in README.md and docs/*.md names a file of the checkout."""
    broken = [(str(md.relative_to(ROOT)), target)
              for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
              for target in re.findall(r"\]\(([^)#\s]+)[^)]*\)", md.read_text())
              if "://" not in target and not (md.parent / target).exists()]
    assert not broken, broken


def test_demo_main_job_passes():
    proc = subprocess.run([sys.executable, "-m", "torch_xaccel.demo", "--device", "cpu"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "OK: compiled model matches eager" in proc.stdout and "gemm_epilogue=" in proc.stdout


def _packages_on_disk():
    """Installed package name of every folder holding an __init__.py (pyproject's package-dir)."""
    roots = {"torch_xaccel": "torch_xaccel", "lowering": "torch_xaccel.lowering", "codegen": "torch_xaccel.codegen"}
    found = {"torch_xaccel.csrc"}  # headers only: listed for its package data
    for folder, name in roots.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *rel)))
    return found


def test_pyproject_lists_every_package():
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert listed == _packages_on_disk()


def test_every_family_has_its_folder_in_every_layer():
    from torch_xaccel import families

    for family in families.FAMILIES:
        if not family.ops:
            continue  # declared, not built
        for layer in ("torch_xaccel/ops", "lowering", "codegen", "tests"):
            assert (ROOT / layer / family.name / "__init__.py").is_file(), (layer, family.name)
        assert family.ops == f"torch_xaccel.ops.{family.name}"
        paths = [*family.passes.values(), *family.providers.values(), *family.after_passes, family.backward_pass,
                 family.trace_hooks, family.bench]
        for path in filter(None, paths):  # each hook lives in its own family's package
            assert f".{family.name}" in path.split(":")[0], path


def _imports(path: pathlib.Path) -> set[str]:
    """Modules a source file imports, absolute (relative imports resolved against its package)."""
    import ast

    rel = path.relative_to(ROOT).with_suffix("").parts
    top = {"lowering": "torch_xaccel.lowering", "codegen": "torch_xaccel.codegen"}.get(rel[0], rel[0])
    package = [top, *rel[1:-1]]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            out.add(module)
            out.update(f"{module}.{a.name}" for a in node.names)
    return out


def test_shared_code_never_imports_a_family_and_ops_never_imports_codegen():
    """Shared infrastructure (backend, runtime, tuning, cache, render, report, config, the
    lowering's normalize and graph_utils) knows families only through families.py, by path; the
    ops (the contract) never import the kernels."""
    from torch_xaccel import families

    names = [f.name for f in families.FAMILIES]
    family_modules = [f"torch_xaccel.{layer}.{n}" for layer in ("ops", "lowering", "codegen", "bench") for n in names]
    family_dirs = [ROOT / layer / n for layer in ("torch_xaccel/ops", "lowering", "codegen") for n in names]
    family_suites = [ROOT / "torch_xaccel" / "bench" / f"{n}.py" for n in names]  # a family's bench: one module
    # tools measuring whole models, every family at once (the model suite waits for gemm_epilogue's builds)
    tools = [ROOT / "torch_xaccel" / "demo.py", ROOT / "torch_xaccel" / "bench" / "model.py"]
    checked = 0
    for path in [*ROOT.glob("torch_xaccel/**/*.py"), *ROOT.glob("lowering/**/*.py"), *ROOT.glob("codegen/**/*.py")]:
        imported = _imports(path)
        if path.is_relative_to(ROOT / "torch_xaccel/ops"):
            assert not [m for m in imported if m.startswith("torch_xaccel.codegen")], path
        if any(d in path.parents for d in family_dirs) or path in family_suites or path in tools:
            continue
        bad = [m for m in imported if any(m == f or m.startswith(f + ".") for f in family_modules)]
        assert not bad, (path, bad)
        checked += 1
    assert checked >= 15


def test_no_file_refers_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    for name in tracked:
        path = ROOT / name
        if path.suffix not in (".py", ".md", ".sh", ".toml", ".jinja", ".cuh", ".h", "") or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        for outside in ("../" + "shared", "/work/" + "shared"):
            assert outside not in text, name
