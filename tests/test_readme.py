"""What README.md and docs/ tell a user to run works as written: the README's two commands at
the top, the "Serving from Python" example of docs/serving.md as a saved script (and, without
its `__main__` guard, an error that names the guard), the one-machine Ray recipe of docs/ray.md,
and install commands that work from a clone of the repository."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from remote_loader.protos import compression
from remote_loader.server.engine.choice import RAY_INSTALL
from tests.helpers import ROOT, subprocess_env

README = (ROOT / "README.md").read_text()
SERVING = ROOT / "docs" / "serving.md"
RAY = ROOT / "docs" / "ray.md"
GUARD = 'if __name__ == "__main__":'
# Within the marks' timeout, so a hung script fails with its output rather than pytest's.
RUN_TIMEOUT = 150


def _python_example(heading: str, page: Path = SERVING) -> str:
    """The first ```python block after `heading` in `page`."""
    text = page.read_text()
    section = text[text.index(heading) :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, f"no python block after {heading!r}"
    return match.group(1)


def _run_script(path: Path) -> subprocess.CompletedProcess[str]:
    """`python PATH` from PATH's folder, as a user runs a saved script; the session is its own,
    so a timeout stops its server's processes too."""
    proc = subprocess.Popen(
        [sys.executable, path.name],
        cwd=path.parent,
        env=subprocess_env(),  # REMOTE_LOADER_CACHE: the demo images go to the test's tmp
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{path.name} ran past {RUN_TIMEOUT} s:\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.timeout(180)
def test_serving_from_python_example_runs_as_a_script(tmp_path: Path) -> None:
    script = tmp_path / "serve_images.py"
    script.write_text(_python_example("## Serving from Python"))
    result = _run_script(script)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"^512 images in one epoch from <Server images on port \d+>$", result.stdout)


@pytest.mark.timeout(180)
def test_serving_from_python_without_the_guard_names_the_guard(tmp_path: Path) -> None:
    code = _python_example("## Serving from Python")
    guarded = re.search(rf"^{re.escape(GUARD)}.*\n    main\(\)\n", code, re.M)
    assert guarded is not None, code
    script = tmp_path / "unguarded.py"
    script.write_text(code.replace(guarded.group(0), "main()\n"))
    result = _run_script(script)
    assert result.returncode == 1, result.stdout + result.stderr
    last = result.stderr.strip().splitlines()[-1]  # the script's own error, raised by Server()
    assert last.startswith("RuntimeError: the server's worker processes cannot start"), last
    assert f"under `{GUARD}`" in last and f"({script})" in last, last
    # Each worker's import of the script failed with the same advice, not multiprocessing's.
    assert "a Server is being built while a worker process imports the main module" in (
        result.stderr
    )
    assert "died" not in result.stderr


def _extra(name: str) -> list[str]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        extras: dict[str, list[str]] = tomllib.load(f)["project"]["optional-dependencies"]
    return extras[name]


TOP_COMMANDS = [
    "python3.11 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0"
    " && pip install . && remote-loader demo",
    "python3.11 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0"
    ' && pip install ".[test]" && python -m pytest',
]


@pytest.mark.unit
def test_the_readme_opens_with_the_two_commands() -> None:
    # A newcomer's first two commands, before any section: the demo, then the tests. They are
    # what a fresh machine with Python 3.11 runs, so they may only change on purpose (here).
    first_block = re.search(r"```bash\n(.*?)```", README, re.S)
    assert first_block is not None
    assert first_block.start() < README.index("\n## "), "the commands come before any section"
    commands = [
        line for line in first_block.group(1).splitlines() if line and not line.startswith("#")
    ]
    assert commands == TOP_COMMANDS, commands
    # CI installs the same torch and runs the same tests; the extra and the command exist.
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install -q torch==2.13.0" in ci and 'pip install -q ".[test]"' in ci, ci
    assert "\npython -m pytest\n" in ci, ci
    with (ROOT / "pyproject.toml").open("rb") as f:
        project = tomllib.load(f)["project"]
    assert "remote-loader" in project["scripts"] and "test" in project["optional-dependencies"]


@pytest.mark.unit
def test_install_commands_work_from_a_clone() -> None:
    # The project is installed from its repository: no package index has "remote-loader".
    printed = [ROOT / "README.md"]
    for folder in ("docs", "src", "examples", "docker"):
        printed.extend(p for p in (ROOT / folder).rglob("*") if p.is_file())
    for path in printed:
        if path.suffix in (".py", ".md", ".toml", ".yml", "") or path.name == "Dockerfile":
            assert "remote-loader[" not in path.read_text(errors="replace"), path
    # The hints name the packages as the extras do, and the extra as a path install.
    assert _extra("ray") == ["ray>=2.40,<3"]
    assert RAY_INSTALL.startswith('pip install "ray>=2.40,<3" '), RAY_INSTALL
    assert 'pip install ".[ray]"' in RAY_INSTALL
    for codec, requirement in zip(compression.CODECS, _extra("compression"), strict=True):
        hint = compression.install_hint(codec)
        assert hint.startswith(f'pip install "{requirement}" '), hint
        assert 'pip install ".[compression]"' in hint


RAY_RECIPE = "On one machine (to try it)"


@pytest.mark.timeout(420)
def test_the_one_machine_ray_recipe_runs_as_written(tmp_path: Path) -> None:
    # Its lines, as a user pastes them, in bash with -e: any failing line fails it. In a PID
    # namespace of its own (we are root in CI), so that its `ray stop` stops only the Ray it
    # started, and whatever is left dies with the namespace. HOME is a fresh folder (the
    # token file goes there) and no RAY_AUTH_* of this session's is passed on.
    recipe = RAY.read_text()
    section = recipe[recipe.index(RAY_RECIPE) :]
    match = re.search(r"```bash\n(.*?)```", section, re.S)
    assert match is not None
    script = "set -euo pipefail\n" + match.group(1)
    env = {k: v for k, v in subprocess_env().items() if not k.startswith("RAY_AUTH_")}
    # Set by tests/test_ray.py for its clusters (a user has none): it refuses `ray start
    # --address` ("Multi-node Ray clusters are not supported").
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    env["HOME"] = str(tmp_path)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    proc = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "bash", "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=400,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "Active:" in proc.stdout, output  # `ray status` answered, with the token
    assert "demo passed" in proc.stdout, output
    assert "workers as Ray actors of 127.0.0.2:6379" in proc.stdout, output
    assert (tmp_path / ".ray" / "auth_token").is_file()  # token authentication was on
    assert "Token authentication is enabled" not in output, output
