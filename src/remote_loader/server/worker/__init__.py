"""The worker process: its loop (`loop`), the one dataset it starts from (`dataset`), fetching
and collating a task (`fetcher`, `collating`) and its allocator. Runs in processes forked from
the fork server and in Ray actors: nothing here imports gRPC
(tests/integration/test_server.py), and it imports only the batch vocabulary, config, `protos`
and the leaves.
"""
