"""The command line: `remote-loader serve | check-config | demo` (`main`) and the demo that runs
a server and trainer processes (`demo`). The top of the server: it may import every other stage.
"""
