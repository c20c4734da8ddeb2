"""The Ray pool backend: a loader's workers as Ray actors across a cluster's nodes (`backend`, the
server's end), through a bridge process that is the only Ray driver (`bridge`, `connect`,
`bridge_process`, `messages`, `starts`, `calls`), direct lanes between actors and the server
(`lane`, `direct`) and each actor's data server for trainers that fetch from its node (`actor`,
`node`). Imports the worker stage, the batch vocabulary, config and the leaves; only its bridge
and actors import Ray.
"""
