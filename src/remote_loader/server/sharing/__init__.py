"""The sharing stage: a hosted loader (`host`), the Runs that produce its epochs (`runs`,
`run`) and the consumers that read them (`consumer`), how a Run's consumers divide them
(`policy` the seam, `policies` the modes, `lanes`, `membership`, `elastic`) and the reorder
buffer. Imports the engine, the batch vocabulary, config and the leaves; reaches the gRPC stage
only through callbacks it is handed.
"""
