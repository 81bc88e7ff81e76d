"""The Dockerfile installs Tessera exactly as the README does (scripts/install.sh).

No Docker engine is available to build the image here, so these tests read the
Dockerfile as text and hold it against scripts/install.sh, README.md and pyproject.toml:
if the install steps change in one place and not the other, a test fails.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
INSTALL_SH = ROOT / "scripts" / "install.sh"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    logical: list[str] = []
    current = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if current and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    assert not current, "Dockerfile ends inside a continued line"
    pairs = []
    for text in logical:
        keyword, _, rest = text.partition(" ")
        pairs.append((keyword.upper(), rest.strip()))
    return pairs


def _args() -> dict[str, str]:
    """Every `ARG NAME=default` in the Dockerfile (later declarations keep their default)."""
    defaults: dict[str, str] = {}
    for keyword, rest in _instructions():
        if keyword == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            defaults[name.strip()] = value.strip().strip('"')
    return defaults


def _install_runs() -> list[str]:
    return [rest for keyword, rest in _instructions() if keyword == "RUN" and "install.sh" in rest]


def _install_script_vars() -> set[str]:
    return set(re.findall(r"\$\{?(TESSERA_[A-Z_]+)", INSTALL_SH.read_text()))


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_image_installs_with_the_readme_script():
    runs = _install_runs()
    assert len(runs) == 1, "exactly one RUN should install Tessera, through scripts/install.sh"
    [run] = runs
    assert "scripts/install.sh" in run
    assert "TESSERA_VENV=/opt/tessera" in run
    # The project is never pip-installed behind the script's back.
    for keyword, rest in _instructions():
        if keyword == "RUN":
            assert "pip install" not in rest, f"install through scripts/install.sh, not: {rest}"


def test_install_variables_are_the_scripts_and_the_readmes():
    [run] = _install_runs()
    passed = set(re.findall(r"\b(TESSERA_[A-Z_]+)=", run))
    assert {"TESSERA_VENV", "TESSERA_TORCH", "TESSERA_TORCH_INDEX"} <= passed
    script_vars = _install_script_vars()
    readme = (ROOT / "README.md").read_text()
    for name in passed:
        assert name in script_vars, f"{name} is set for install.sh, which does not read it"
        assert name in readme, f"{name} is used by the image but not documented in README.md"
    for name in ("TESSERA_TORCH", "TESSERA_TORCH_INDEX"):
        assert name in _args(), f"the Dockerfile should take {name} as a build arg"


def test_torch_pin_matches_install_script_and_readme():
    match = re.search(r"\$\{TESSERA_TORCH:-([^}]+)\}", INSTALL_SH.read_text())
    assert match, "scripts/install.sh no longer has a TESSERA_TORCH default"
    script_default = match.group(1).strip('"')
    assert _args()["TESSERA_TORCH"] == script_default
    assert script_default in (ROOT / "README.md").read_text()


def test_extras_passed_to_install_script_exist():
    [run] = _install_runs()
    extras = set(re.findall(r'extras="([^"]*)"', run)) - {""}
    assert extras == {"gpu"}, "the CUDA image installs the [gpu] extra (FlashInfer, Triton)"
    assert extras <= set(_pyproject()["project"]["optional-dependencies"])
    assert "flashinfer-python" in _pyproject()["project"]["optional-dependencies"]["gpu"]


def test_device_variants():
    args = _args()
    assert args["DEVICE"] == "cuda"
    froms = [rest for keyword, rest in _instructions() if keyword == "FROM"]
    stage_names = {rest.split()[-1] for rest in froms if " AS " in rest.upper()}
    assert {"base-cuda", "base-cpu", "base", "build", "runtime"} <= stage_names
    assert any("${DEVICE}" in rest for rest in froms), "the base stage is picked by DEVICE"
    assert "cuda" in args["CUDA_IMAGE"] and "runtime" in args["CUDA_IMAGE"]
    [run] = _install_runs()
    assert "download.pytorch.org/whl/cpu" in run, "DEVICE=cpu defaults to the CPU torch index"
    assert froms[-1].split()[-1] == "runtime", "the last stage is the image that runs"


def test_build_context_has_what_the_install_needs():
    copied = " ".join(rest for keyword, rest in _instructions() if keyword == "COPY")
    include = _pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {pattern.rstrip("*") for pattern in include}
    readme = _pyproject()["project"]["readme"]
    ignored = {
        line.strip().rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for path in {"pyproject.toml", readme, "scripts", "configs", *packages}:
        assert path in copied, f"the image build does not COPY {path}"
        assert path not in ignored, f".dockerignore hides {path} from the build"
    for path in (".venv", ".git"):
        assert path in ignored


def _copied_source_folders() -> list[Path]:
    """The repository folders the image build COPYs (`COPY engine/ engine/` and the like)."""
    folders = []
    for keyword, rest in _instructions():
        if keyword == "COPY" and not rest.startswith("--"):
            source = rest.split()[0]
            if source.endswith("/") and (ROOT / source).is_dir():
                folders.append(ROOT / source)
    return folders


def test_shipped_code_does_not_import_the_tests():
    # tests/ is not in the image (.dockerignore): a shipped module importing it, such as
    # a benchmark reusing an e2e helper, works in a checkout and fails in the container.
    folders = _copied_source_folders()
    assert {folder.name for folder in folders} >= {"engine", "server", "kernels", "bench"}
    offenders = []
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names = [node.module]
                else:
                    continue
                offenders += [
                    f"{path.relative_to(ROOT)}:{node.lineno} imports {name}"
                    for name in names
                    if name == "tests" or name.startswith("tests.")
                ]
    assert not offenders, "\n".join(offenders)


def test_runtime_contract():
    pairs = _instructions()
    runtime_start = max(i for i, (kw, rest) in enumerate(pairs) if kw == "FROM")
    runtime = pairs[runtime_start:]
    values = {kw: rest for kw, rest in runtime}

    user = values["USER"].split(":")[0]
    assert user.isdigit() and int(user) != 0, "run as a numeric non-root uid"
    assert values["EXPOSE"] == "8000"
    assert "/health" in values["HEALTHCHECK"]
    assert json.loads(values["ENTRYPOINT"]) == ["tessera", "serve"]
    assert "tessera" in _pyproject()["project"]["scripts"]
    env = " ".join(rest for kw, rest in runtime if kw == "ENV")
    env_pairs = dict(token.split("=", 1) for token in shlex.split(env) if "=" in token)
    assert env_pairs["PATH"].startswith("/opt/tessera/bin:"), "tessera must be on PATH"
    assert env_pairs["TESSERA_HOST"] == "0.0.0.0"
    assert env_pairs["TESSERA_PORT"] == "8000"
    assert "/models" in DOCKERFILE.read_text()


def test_kubernetes_runs_as_the_image_user():
    yaml = pytest.importorskip("yaml")
    deployment = yaml.safe_load((ROOT / "deploy" / "k8s" / "deployment.yaml").read_text())
    values = {kw: rest for kw, rest in _instructions()}
    uid = int(values["USER"].split(":")[0])
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == uid
