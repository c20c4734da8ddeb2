"""What README.md and docs/ tell a user to run works as written: the README's two commands at
the top, the "Serving from Python" example of docs/serving.md as a saved script (and, without
its `__main__` guard, an error that names the guard), the one-machine Ray recipe of docs/ray.md,
and install commands that work from a clone of the repository.

The unit tests (no server, no process, no Ray): tests/unit/test_readme.py.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, subprocess_env

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
    # Set by tests/helpers.py for its clusters (a user has none): it refuses `ray start
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
