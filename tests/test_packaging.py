"""What `pip install torch-xaccel` gives: one version, the licence in the metadata, every extra
declared, and a wheel that works in a fresh virtual environment holding nothing but torch (and
what torch itself needs): no test, ONNX, CUDA or bench packages."""
import email
import importlib.metadata
import os
import pathlib
import subprocess
import sys
import textwrap
import tomllib
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
EXTRAS = {"triton", "cuda12", "cuda13", "onnx", "bench", "test"}
# imported only on the paths that need them (ONNX export, the CUDA kernels' build, the bench, the tests)
OPTIONAL = ["onnx", "onnxruntime", "onnxscript", "xlstm", "mlstm_kernels", "flashrnn", "transformers", "matplotlib",
            "cutlass_library", "cuda.core", "pytest"]


def _requirement_names(reqs) -> set[str]:
    from packaging.requirements import Requirement

    return {Requirement(r).name.lower().replace("_", "-") for r in reqs}


def test_version_has_one_source():
    import torch_xaccel

    assert "version" not in PROJECT and "version" in PROJECT["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "torch_xaccel.__version__"}
    # a plain literal: setuptools reads it without importing the package (and torch)
    assert f'\n__version__ = "{torch_xaccel.__version__}"' in (ROOT / "torch_xaccel" / "__init__.py").read_text()
    assert importlib.metadata.version("torch-xaccel") == torch_xaccel.__version__


def test_licence_and_metadata():
    import torch_xaccel

    licence = (ROOT / "LICENSE").read_text()
    assert licence.startswith("Copyright 2026 The torch_xaccel authors")
    assert "Apache License\n" in licence and "Version 2.0, January 2004" in licence
    assert PROJECT["license"] == "Apache-2.0" and PROJECT["license-files"] == ["LICENSE"]
    assert (ROOT / "torch_xaccel" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["torch_xaccel"]
    assert (ROOT / "CHANGELOG.md").read_text().count(f"## [{torch_xaccel.__version__}]") == 1
    classifiers = PROJECT["classifiers"]
    assert "Development Status :: 3 - Alpha" in classifiers
    # the Python versions claimed are the ones tested (CI: this interpreter; GPU machine: 3.12)
    assert f"Programming Language :: Python :: {sys.version_info.major}.{sys.version_info.minor}" in classifiers
    assert PROJECT["requires-python"] == ">=3.11"  # the tests import tomllib
    assert set(PROJECT["urls"]) >= {"Homepage", "Documentation", "Changelog"}


def test_runtime_dependencies_and_extras():
    assert _requirement_names(PROJECT["dependencies"]) == {"torch", "jinja2"}
    extras = PROJECT["optional-dependencies"]
    assert set(extras) == EXTRAS
    assert "onnxruntime" not in _requirement_names(extras["onnx"])  # the user picks onnxruntime or -gpu
    assert {"cuda-core", "cuda-bindings", "nvidia-cutlass"} <= _requirement_names(extras["cuda12"])
    assert "nvidia-cuda-nvrtc-cu12" in _requirement_names(extras["cuda12"])
    assert "nvidia-cuda-nvrtc" in _requirement_names(extras["cuda13"])
    assert "matplotlib" in _requirement_names(extras["bench"])


def test_installed_torch_is_in_the_declared_range():
    import torch
    from packaging.requirements import Requirement
    from packaging.version import Version

    torch_req = next(Requirement(r) for r in PROJECT["dependencies"] if r.startswith("torch"))
    assert Version(torch.__version__.split("+")[0]) in torch_req.specifier, (torch.__version__, torch_req)
    try:
        import triton
    except ImportError:
        return
    triton_req = Requirement(PROJECT["optional-dependencies"]["triton"][0])
    assert Version(triton.__version__) in triton_req.specifier, (triton.__version__, triton_req)


def _closure(name: str) -> list[importlib.metadata.Distribution]:
    """The installed distribution `name` and everything it needs here, recursively (with the extras
    its requirements name: torch's CUDA builds ask for cuda-toolkit[cublas,...])."""
    from packaging.requirements import Requirement

    seen, todo, out = set(), [(name, "")], {}
    while todo:
        key, extra = todo.pop()
        key = key.lower().replace("_", "-")
        if (key, extra) in seen:
            continue
        seen.add((key, extra))
        dist = importlib.metadata.distribution(key)  # a requirement of an installed package is installed
        out.setdefault(key, dist)
        for r in dist.requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": extra}):
                todo += [(req.name, e) for e in ("", *req.extras)]
    return list(out.values())


def _shadow_site(dists, folder: pathlib.Path) -> None:
    """`folder` holds links to exactly the files of `dists` (a namespace package such as nvidia/ or
    cuda/ gets only its members from these distributions)."""
    for dist in dists:
        base = pathlib.Path(dist.locate_file(""))
        for f in dist.files or []:
            if f.parts[0] == "..":
                continue  # scripts and data outside site-packages
            target = folder / f
            if target.exists() or not (base / f).exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(base / f)


def test_wheel_works_in_a_fresh_venv_without_extras(tmp_path):
    """The wheel (built by `python -m build`, from its sdist) installs into a new venv that sees only
    this torch and its own requirements, with no index: nothing beyond torch and jinja2 is needed;
    there, the entry point compiles a model and the demo passes, with the optional packages absent."""
    pytest.importorskip("build")
    dist = tmp_path / "dist"
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(ROOT)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import torch_xaccel

    version = torch_xaccel.__version__
    wheel = dist / f"torch_xaccel-{version}-py3-none-any.whl"
    assert wheel.is_file() and (dist / f"torch_xaccel-{version}.tar.gz").is_file(), sorted(os.listdir(dist))
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        meta = email.message_from_bytes(zf.read(f"torch_xaccel-{version}.dist-info/METADATA"))
    assert {"torch_xaccel/py.typed", f"torch_xaccel-{version}.dist-info/licenses/LICENSE"} <= names
    assert any(n.startswith("torch_xaccel/csrc/") and n.endswith(".cuh") for n in names)
    assert any(n.startswith("torch_xaccel/codegen/") and n.endswith(".jinja") for n in names)
    assert not any(n.startswith(("tests/", "lowering/", "codegen/")) for n in names)
    assert meta["Version"] == version and meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    assert set(meta.get_all("Provides-Extra")) == EXTRAS
    plain = [r for r in meta.get_all("Requires-Dist") if "extra ==" not in r]
    assert _requirement_names(plain) == {"torch", "jinja2"}, plain

    venv, shadow = tmp_path / "venv", tmp_path / "torch-site"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    _shadow_site(_closure("torch"), shadow)
    pathlib.Path(site, "torch_closure.pth").write_text(f"{shadow}\n")
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index",
                           "--no-cache-dir", "--disable-pip-version-check", "-q", str(wheel)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    check = textwrap.dedent(f"""
        import importlib.metadata, importlib.util, pathlib, sys, torch
        def absent(name):
            try:
                return importlib.util.find_spec(name) is None
            except ModuleNotFoundError:
                return True
        present = [m for m in {OPTIONAL!r} if not absent(m)]
        assert not present, present
        f = lambda x, w, b: torch.nn.functional.gelu(x @ w.t() + b) * 2
        x, w, b = torch.randn(8, 16), torch.randn(32, 16), torch.randn(32)
        y = torch.compile(f, backend="xaccel")(x, w, b)  # the entry point, before any import
        torch.testing.assert_close(y, f(x, w, b))
        import torch_xaccel
        assert pathlib.Path(torch_xaccel.__file__).is_relative_to({site!r}), torch_xaccel.__file__
        assert (pathlib.Path(torch_xaccel.__file__).parent / "py.typed").is_file()
        assert importlib.metadata.version("torch-xaccel") == torch_xaccel.__version__ == {version!r}
        print("gemm_epilogue", torch_xaccel.last_report().counts()["gemm_epilogue"])
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    # the measured choice (Inductor candidates, minutes on a CPU) is tested elsewhere; here, the install
    env.update(XACCEL_CACHE_DIR=str(tmp_path / "cache"), XACCEL_CHOOSE="0")
    run = dict(capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)
    proc = subprocess.run([str(python), "-c", check], **run)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gemm_epilogue 1" in proc.stdout, proc.stdout
    proc = subprocess.run([str(python), "-m", "torch_xaccel.demo", "--device", "cpu", "--batch", "2", "--seq", "8"],
                          **run)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "OK: compiled model matches eager" in proc.stdout and "ONNX: skipped" in proc.stdout, proc.stdout[-3000:]

