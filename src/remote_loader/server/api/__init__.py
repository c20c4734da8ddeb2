"""The gRPC face: the Server as a whole (ports, start, drain), the Loader service and each
stream it sends (`service`, `stream`), its settings, request validation, stream admission and
authentication, and how a failed call ends on the wire; the trainers' stall reports (`report`),
the status snapshot (`snapshot`) and its page on the metrics port (`page`). Imports the sharing
stage and everything below it, never the command line.
"""
