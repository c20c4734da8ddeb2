"""Makes the README's screenshots of `remote-loader top` and the status page (docs/images/).

A server with two loaders: "images", whose one slow worker two trainers (ranks of the job
"train") wait on, and "fast", whose workers keep up with a trainer of the job "eval". After
SETTLE seconds, `top --once` is drawn to a PNG with PIL, and headless chromium takes the page.

    PYTHONPATH=src:. python docs/screenshots.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from remote_loader.server.api.server import Server
from remote_loader.server.api.settings import ServerSettings
from tests.stalls import Trainer, fast_spec, stalled_spec

OUT = Path(__file__).resolve().parent / "images"
SETTLE = 25.0  # seconds of history before the pictures
FONT = "/usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf"
BOLD = "/usr/share/fonts/truetype/dejavu/DejaVuSansMono-Bold.ttf"
COLOURS = {"plain": (220, 220, 220), "title": (255, 255, 255), "hot": (255, 95, 95)}


def top_text(address: str) -> str:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    command = [sys.executable, "-m", "remote_loader.server.cli.main", "top", address, "--once"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    return result.stdout


def draw_terminal(text: str, path: Path) -> None:
    """`text` as a terminal shows it: light on dark, titles bold, stalled trainers red."""
    font, bold = ImageFont.truetype(FONT, 15), ImageFont.truetype(BOLD, 15)
    lines = text.rstrip("\n").splitlines()
    width = max(len(line) for line in lines)
    cell_w, cell_h = round(font.getbbox("M")[2]), 20
    image = Image.new("RGB", (cell_w * width + 32, cell_h * len(lines) + 32), (24, 24, 28))
    pen = ImageDraw.Draw(image)
    for row, line in enumerate(lines):
        title = line.startswith(("remote-loader top", "loader "))
        hot = "workers" in line and "%" in line and not line.lstrip().startswith("JOB")
        colour = COLOURS["title" if title else "hot" if hot else "plain"]
        pen.text((16, 16 + row * cell_h), line, font=bold if title else font, fill=colour)
    image.save(path)


def page_screenshot(port: int, path: Path) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("needs chromium (apt-get install -y chromium)")
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--no-first-run",
                f"--user-data-dir={profile}",
                "--hide-scrollbars",
                "--window-size=1280,640",
                "--virtual-time-budget=5000",
                f"--screenshot={path}",
                f"http://127.0.0.1:{port}/status",
            ],
            capture_output=True,
            check=True,
            timeout=120,
        )


def main() -> None:
    OUT.mkdir(exist_ok=True)
    settings = ServerSettings(address="127.0.0.1:0", metrics_address="127.0.0.1:0")
    with Server(settings, [stalled_spec("images"), fast_spec("fast")]) as server:
        trainers = [
            Trainer(server.address, "images", job="train", rank=r, world_size=2).start()
            for r in range(2)
        ]
        trainers.append(Trainer(server.address, "fast", step=0.02, job="eval").start())
        try:
            time.sleep(SETTLE)
            text = top_text(server.address)
            print(text)
            draw_terminal(text, OUT / "top.png")
            assert server.metrics_port is not None
            page_screenshot(server.metrics_port, OUT / "status-page.png")
        finally:
            for trainer in trainers:
                trainer.stop()
    print(f"wrote {OUT / 'top.png'} and {OUT / 'status-page.png'}")


if __name__ == "__main__":
    main()
