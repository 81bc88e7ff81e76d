"""scripts/install.sh, run against a stand-in virtualenv whose pip logs its calls.

scripts/serve.sh runs it before every start: it re-ran `pip install -e .`, ~5 s a start,
and failed on a host without network (pip's build step fetches setuptools)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _project(tmp_path: Path) -> Path:
    """A copy of the script beside a pyproject.toml, and a virtualenv whose python has
    torch and whose pip writes `tessera` into bin/ as an install does."""
    (tmp_path / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "install.sh", tmp_path / "scripts")
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "tessera"\n')
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    scripts = {
        "python": "#!/bin/sh\nexit 0\n",
        "pip": f'#!/bin/sh\necho "$*" >> {tmp_path}/pip.log\n'
        f"printf '#!/bin/sh\\n' > {bin_dir}/tessera; chmod +x {bin_dir}/tessera\n",
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return tmp_path


def _install(project: Path, *extras: str, venv: Path | None = None) -> list[str]:
    env = {"PATH": "/usr/bin:/bin", **({"TESSERA_VENV": str(venv)} if venv else {})}
    subprocess.run(["bash", "scripts/install.sh", *extras], cwd=project, check=True, env=env)
    log = project / "pip.log"
    return log.read_text().splitlines() if log.exists() else []


def test_tessera_is_installed_once_per_pyproject_and_extras(tmp_path):
    project = _project(tmp_path)
    assert _install(project) == ["install -q -e ."]
    assert _install(project) == ["install -q -e ."]  # nothing changed: no pip
    assert _install(project, "test") == ["install -q -e .", "install -q -e .[test]"]
    assert len(_install(project, "test")) == 2
    with (project / "pyproject.toml").open("a") as pyproject:  # a new dependency
        pyproject.write('dependencies = ["x"]\n')
    assert len(_install(project)) == 3
    assert len(_install(project)) == 3
    (project / ".venv" / "bin" / "tessera").unlink()  # uninstalled behind its back
    assert _install(project)[3:] == ["install -q -e ."]


def test_another_checkout_sharing_the_virtualenv_installs_its_own(tmp_path):
    """The stamp named no checkout: a second clone using the same TESSERA_VENV skipped the
    install, and serve.sh ran the first clone's code (fuzz74)."""
    first, second = _project(tmp_path / "first"), _project(tmp_path / "second")
    shared = first / ".venv"  # its pip logs to first/pip.log
    assert len(_install(first, venv=shared)) == 1
    _install(second, venv=shared)
    assert len(_install(first, venv=shared)) == 3  # the second, then the first again
    assert len(_install(first, venv=shared)) == 3  # and no more
