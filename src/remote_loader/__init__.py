"""remote-loader: a torch DataLoader served over gRPC.

`remote_loader.client` is the trainer's side (`RemoteLoader`), `remote_loader.server` the
service (`Server`, `remote-loader serve`), `remote_loader.protos` the wire both speak. The client
and the server import `protos`, never each other.
"""
