"""`remote-loader serve` and `demo` as processes, as a user runs them.

The unit tests (no server, no process, no Ray): tests/unit/test_cli.py.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import torch

from remote_loader.client import RemoteLoader
from remote_loader.server.cli.main import serve_command
from tests.helpers import serve_process, stop_process, subprocess_env

SQUARES_FLAGS = (
    "--dataset",
    "tests.datasets:Squares",
    "--batch-size",
    "5",
    "--shuffle",
    "--num-workers",
    "1",
    "--seed",
    "3",
)


def _order(address: str, epoch: int) -> list[int]:
    with RemoteLoader(address) as loader:
        loader.set_epoch(epoch)
        return torch.cat([b["index"] for b in loader]).tolist()


def test_same_seed_and_epoch_same_order_from_two_servers() -> None:
    first, a = serve_process(*SQUARES_FLAGS)
    second, b = serve_process(*SQUARES_FLAGS)
    try:
        assert _order(a, 0) == _order(b, 0)
        assert _order(a, 1) == _order(b, 1)
        assert _order(a, 0) != _order(a, 1)
        assert sorted(_order(b, 2)) == list(range(50))
    finally:
        for proc in (first, second):
            code, err = stop_process(proc)
            assert code == 0, err


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        serve_command(args),
        capture_output=True,
        text=True,
        timeout=60,
        env=subprocess_env(),
    )


def test_option_conflict_in_config_fails_start(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(
        '[loaders.a]\ndataset = "tests.datasets:Squares"\npersistent_workers = true\n'
    )
    result = _serve("--config", str(config))
    assert result.returncode == 2
    assert "ValueError: persistent_workers option needs num_workers > 0" in result.stderr


def test_bad_import_path_fails_start(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[loaders.a]\ndataset = "tests.datasets:Nope"\n')
    result = _serve("--config", str(config))
    assert result.returncode == 2
    assert "module 'tests.datasets' has no attribute 'Nope'" in result.stderr


def test_demo_runs_two_trainers_and_checks_every_sample() -> None:
    # No speed assert (it flaked on a loaded machine): the timeout only says it does not hang.
    result = subprocess.run(
        [sys.executable, "-m", "remote_loader.server.cli.main", "demo", "--epochs", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "demo passed" in result.stdout
    # The two trainers are the ranks of one job: each gets half of every epoch.
    assert result.stdout.count("8 batches, 256 samples") == 2
    assert result.stdout.count("MB/s over shm") == 2  # one host: through shared memory
    assert (
        "epoch 0: 2 equal shares of 256 samples; together every one of the 512 samples, "
        "none twice: yes" in result.stdout
    )
    # Progress into a pipe: plain lines, none blank, no carriage returns or cursor moves.
    assert "trainer 1: 8/8 batches in " in result.stderr, result.stderr
    assert "\r" not in result.stderr and "\x1b" not in result.stderr, result.stderr
    assert all(line.strip() for line in result.stderr.splitlines()), result.stderr


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = subprocess_env()  # the configs name tests.datasets
    return subprocess.run(
        [sys.executable, "-m", "remote_loader.server.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_check_config(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text(
        '[loaders.train]\ndataset = "tests.datasets:Squares"\nbatch_size = 8\nnum_workers = 2\n'
        '\n[loaders.stream]\ndataset = "tests.datasets:Sharded"\nbatch_size = 2\n'
    )
    result = _cli("check-config", str(good))
    assert result.returncode == 0, result.stderr
    assert "train: tests.datasets:Squares, map dataset, batch_size 8, 7 batches/epoch" in (
        result.stdout
    )
    assert "stream: tests.datasets:Sharded, iterable dataset, batch_size 2, length unknown " in (
        result.stdout
    )
    assert "2 loader(s), all valid" in result.stdout

    conflict = tmp_path / "conflict.toml"
    conflict.write_text(
        '[loaders.a]\ndataset = "tests.datasets:Squares"\npersistent_workers = true\n'
    )
    result = _cli("check-config", str(conflict))
    assert result.returncode == 2
    assert (
        "loader 'a': ValueError: persistent_workers option needs num_workers > 0" in result.stderr
    )

    bad_import = tmp_path / "bad.toml"
    bad_import.write_text('[loaders.a]\ndataset = "tests.datasets:Nope"\n')
    result = _cli("check-config", str(bad_import))
    assert result.returncode == 2
    assert "module 'tests.datasets' has no attribute 'Nope'" in result.stderr


def test_check_config_shows_workers_and_pool_as_configured(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(
        '[server]\nray_address = "127.0.0.1:6379"\n'
        '[loaders.auto]\ndataset = "tests.datasets:Squares"\nnum_workers = "auto"\n'
        'seeding = "per_batch"\nmax_workers = 3\n'
        '[loaders.ray]\ndataset = "tests.datasets:Squares"\nnum_workers = 2\npool = "ray"\n'
        '[loaders.inline]\ndataset = "tests.datasets:Sharded"\n'
    )
    result = _cli("check-config", str(config))
    assert result.returncode == 0, result.stderr
    assert "num_workers auto (1 to max_workers 3), pool local," in result.stdout
    assert "num_workers 2, pool ray (ray_address 127.0.0.1:6379, ray_num_cpus 1)," in (
        result.stdout
    )
    assert "length unknown (IterableDataset without __len__), num_workers 0, pool local (no " in (
        result.stdout
    )


# Runs the CLI in a Python where `import ray` fails, as where Ray is not installed: a None in
# sys.modules makes the import raise ImportError (not a stub: the real import machinery).
WITHOUT_RAY = (
    "import sys; sys.modules['ray'] = None; "
    "from remote_loader.server.cli.main import main; sys.exit(main(sys.argv[1:]))"
)


def test_ray_pool_without_ray_is_refused_with_the_install_command(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(
        '[loaders.a]\ndataset = "tests.datasets:Squares"\nnum_workers = 1\npool = "ray"\n'
    )
    install = 'pip install "ray>=2.40,<3" (or, in a clone of the repository, pip install ".[ray]")'
    for command in (
        ["check-config", str(config)],
        ["serve", "--address", "127.0.0.1:0", "--config", str(config)],
    ):
        result = subprocess.run(
            [sys.executable, "-c", WITHOUT_RAY, *command],
            capture_output=True,
            text=True,
            timeout=90,
            env=subprocess_env(),
        )
        assert result.returncode == 2, (command, result.stdout, result.stderr)
        assert "loader 'a' has pool = \"ray\", but Ray cannot be imported here" in result.stderr
        assert install in result.stderr
        assert "serving" not in result.stdout


def test_serve_on_a_port_in_use_says_so_in_its_own_words() -> None:
    # Another server listens on the port (with SO_REUSEADDR, as servers do).
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "remote_loader.server.cli.main",
                "serve",
                "--address",
                f"127.0.0.1:{port}",
                *SQUARES_FLAGS,
            ],
            capture_output=True,
            text=True,
            timeout=90,
            env=subprocess_env(),
        )
    assert result.returncode == 2, result.stdout
    assert result.stderr.strip() == (
        f"remote-loader: error: cannot listen on 127.0.0.1:{port}: port {port} is already in "
        f"use (is another server using it? `ss -ltnp 'sport = :{port}'` shows which process): "
        "stop it, or choose another port (port 0 picks a free one)"
    )  # gRPC's add_port.cc line and GRPC_VERBOSITY hint are not printed before it


def test_health_command() -> None:
    proc, address = serve_process(*SQUARES_FLAGS)
    try:
        result = _cli("health", address)
        assert (result.returncode, result.stdout.strip()) == (0, f"{address}: SERVING")
    finally:
        stop_process(proc)
    result = _cli("health", address, "--timeout", "1")  # nobody listens there any more
    assert result.returncode == 2
    assert "no health answer" in result.stderr
