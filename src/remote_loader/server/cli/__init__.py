"""The command line: `remote-loader serve | check-config | health | top | demo` (`main`), the
live view of a running server (`top`, over the channel `channel` opens, as `health` does) and
the demo that runs a server and trainer processes (`demo`). The top of the server: it may import
every other stage.
"""
