"""Telemetry: what the server tells about itself. Each loader's Prometheus metrics (`metrics`)
and the consumers that get series of their own (`series`), the metrics port that serves them and
whatever page the server hands it (`exposition`), the trainers' stall as they report it
(`stall`) and log lines as `key=value` pairs (`logfmt`). A leaf every stage may import: imports
only `protos`, never another stage of the server.
"""
