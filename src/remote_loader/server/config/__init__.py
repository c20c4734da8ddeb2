"""Config: a loader's spec (`spec`, read from a TOML config file: `file`, or from flags:
`flags`), the modes it takes as Literal aliases (`types`), its parts per stage (`parts`) and
sampling, torch's option rules and the (seed, epoch) -> batch indices of an epoch. Imports
nothing of the server but the leaves.
"""
