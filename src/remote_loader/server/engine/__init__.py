"""The engine: the seam a Run drives (`seam`: begin_epoch / submit / poll / end_epoch), the
pool core (`pool`, `ledger`, `supervisor`, `dispatch`, `slots`, `autotune`), its backends
(`backend` the seam they fill, `local` worker processes, `ray/` Ray actors), the choice of one
for a loader (`choice`: `make_pool`) and the server's settings every pool is made with
(`options`: PoolOptions), in-process loading (`inline`), kept pools and the fork server workers
start from. Imports the worker stage, the batch vocabulary, config and the leaves; never the
sharing or gRPC stages.
"""
