"""The status page on the metrics port: what `remote-loader top` shows, in a browser, refreshed
every second from `/status.json` (the Status RPC's snapshot as JSON), with plots of each
consumer's rate and stall over the last minute drawn as inline SVG. No external assets.

Paths: `/status.json` the snapshot; `/status`, and `/` asked for by a browser (its Accept
names text/html), the page; anything else, as before, the Prometheus metrics (a scraper or
curl asking for `/` still gets them). Like the metrics, it has no token and no TLS: bind the
port where only your people and monitoring reach it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from google.protobuf import json_format

from remote_loader.protos import loader_pb2 as pb
from remote_loader.server.telemetry.exposition import WSGIApp

# The page runs only its own inline script and style, and fetches only from this port.
HEADERS = [
    (
        "Content-Security-Policy",
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "connect-src 'self'",
    ),
    ("Cache-Control", "no-store"),
]


def status_json(status: pb.ServerStatus) -> bytes:
    """`status` as the page reads it: protobuf's JSON mapping, field names as in the .proto,
    every field present (uint64 fields are strings, as that mapping has them)."""
    as_dict = json_format.MessageToDict(
        status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return json.dumps(as_dict, separators=(",", ":")).encode()


def status_pages(status: Callable[[], pb.ServerStatus]) -> Callable[[WSGIApp], WSGIApp]:
    """Wraps the metrics application: the page and its JSON from `status()`, the rest to it."""

    def wrap(metrics: WSGIApp) -> WSGIApp:
        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            path = environ.get("PATH_INFO", "/")
            if path == "/status.json":
                body = status_json(status())
                kind = "application/json"
            elif path == "/status" or (
                path == "/" and "text/html" in environ.get("HTTP_ACCEPT", "")
            ):
                body, kind = PAGE.encode(), "text/html; charset=utf-8"
            else:
                return metrics(environ, start_response)
            start_response(
                "200 OK",
                [("Content-Type", kind), ("Content-Length", str(len(body))), *HEADERS],
            )
            return [body]

        return app

    return wrap


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>remote-loader status</title>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222;background:#fafafa}
h1{font-size:1.3em;margin:0 0 .3em} h2{font-size:1.1em;margin:1.2em 0 .2em}
.loader-figures{color:#444;margin-bottom:.4em}
.loader-busy{color:#666;font-size:.9em;margin-bottom:.4em}
table{border-collapse:collapse;background:#fff}
td,th{padding:.25em .6em;border-bottom:1px solid #ddd;text-align:right;white-space:nowrap}
th{background:#eee} td.name{text-align:left}
.stage-workers{color:#b00} .stage-in-flight{color:#a60} .stage-copy{color:#06a}
.legend{color:#666;font-size:.9em;margin-top:1em;max-width:60em}
#updated{color:#666}
</style></head>
<body>
<h1>remote-loader <span id="updated">(loading)</span></h1>
<div id="loaders"></div>
<p class="legend">Stall: the share of its last seconds (about 10) a trainer spent blocked in
next(). Stage: what held the batches it waited for: <b>workers</b> (not made yet when its stream
asked: more workers or a faster dataset), <b>in flight</b> (made, not yet at the trainer:
network, flow control), <b>copy</b> (receiving, decoding, copying to the device). Plots: the last
minute, one point a second. Lag: batches behind; ready: made and waiting for the trainer.</p>
<script>
"use strict";
const SVG = "http://www.w3.org/2000/svg";
function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function pct(x) { return (100 * Number(x)).toFixed(0) + "%"; }
function num(x, digits) { return Number(x).toFixed(digits); }
function plot(values, top, color, label) {
  const w = 180, h = 36, svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("width", w); svg.setAttribute("height", h);
  svg.setAttribute("viewBox", "0 0 " + w + " " + h);
  svg.setAttribute("class", "plot"); svg.setAttribute("aria-label", label);
  const frame = document.createElementNS(SVG, "rect");
  frame.setAttribute("width", w); frame.setAttribute("height", h);
  frame.setAttribute("fill", "#f4f4f4");
  svg.appendChild(frame);
  const max = Math.max(top, ...values.map(Number), 1e-9), n = values.length;
  if (n > 0) {
    const pts = values.map((v, i) =>
      ((n === 1 ? w : i * w / (n - 1))).toFixed(1) + "," +
      (h - 2 - (h - 4) * Number(v) / max).toFixed(1));
    const line = document.createElementNS(SVG, "polyline");
    line.setAttribute("points", pts.join(" "));
    line.setAttribute("fill", "none"); line.setAttribute("stroke", color);
    line.setAttribute("stroke-width", "1.5");
    svg.appendChild(line);
  }
  return svg;
}
function render(status) {
  const root = document.getElementById("loaders");
  root.replaceChildren();
  for (const loader of status.loaders) {
    const box = el("section", {class: "loader", "data-loader": loader.name});
    box.appendChild(el("h2", {}, "loader " + loader.name));
    box.appendChild(el("div", {class: "loader-figures"},
      loader.backend + ", " + loader.workers + " workers " + pct(loader.busy) + " busy, CPU " +
      num(loader.cpu_cores_used, 1) + "/" + loader.cores + " cores, " +
      num(loader.batches_per_second, 1) + " batches/s, " +
      num(loader.bytes_per_second / 1e6, 1) + " MB/s out; per batch: make " +
      num(loader.make_seconds * 1e3, 1) + " ms, stream wait " +
      num(loader.stream_wait_seconds * 1e3, 1) + " ms, send " +
      num(loader.send_seconds * 1e3, 1) + " ms"));
    const busy = el("div", {class: "loader-busy"});
    busy.appendChild(plot(loader.busy_history, 1, "#555", "workers busy"));
    busy.appendChild(el("span", {}, " workers busy, last minute"));
    box.appendChild(busy);
    const table = el("table", {class: "consumers"});
    const head = el("tr");
    for (const h of ["job", "rank", "sharing", "epoch", "stall", "stage", "batches/s", "lag",
                     "ready", "stall, last minute", "rate, last minute"]) {
      head.appendChild(el("th", {}, h));
    }
    table.appendChild(head);
    for (const c of loader.consumers) {
      const who = c.consumer;
      const row = el("tr", {class: "consumer", "data-job": who.job, "data-rank": who.rank,
        "data-stage": c.stage, "data-stall": c.reported ? num(c.wait_fraction, 3) : ""});
      row.appendChild(el("td", {class: "name"}, who.job));
      row.appendChild(el("td", {}, who.rank + "/" + who.world_size));
      row.appendChild(el("td", {class: "name"}, who.sharing));
      row.appendChild(el("td", {}, c.epoch));
      row.appendChild(el("td", {class: "stall"}, c.reported ? pct(c.wait_fraction) : "?"));
      row.appendChild(el("td", {class: "stage stage-" + (c.stage || "none").replace(" ", "-")},
        c.reported ? (c.stage || "-") : "(no reports)"));
      row.appendChild(el("td", {}, num(c.batches_per_second, 1)));
      row.appendChild(el("td", {}, c.attached ? c.lag : "-"));
      row.appendChild(el("td", {}, c.attached ? c.ready : "-"));
      const stall = el("td"), rate = el("td");
      stall.appendChild(plot(c.wait_history, 1, "#b00", "stall"));
      rate.appendChild(plot(c.rate_history, 0, "#06a", "batches/s"));
      row.appendChild(stall); row.appendChild(rate);
      table.appendChild(row);
    }
    box.appendChild(table);
    root.appendChild(box);
  }
  document.getElementById("updated").textContent = "status at " +
    new Date().toLocaleTimeString();
}
async function refresh() {
  try {
    const reply = await fetch("/status.json", {cache: "no-store"});
    render(await reply.json());
  } catch (e) {
    document.getElementById("updated").textContent = "(no answer: " + e + ")";
  }
}
refresh();
setInterval(refresh, 1000);
</script>
</body></html>
"""
