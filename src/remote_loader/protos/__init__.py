"""The wire of remote-loader: the gRPC service definition, its generated stubs and the batch codec.

Both the server and the client import this package; it imports neither of them.
"""
