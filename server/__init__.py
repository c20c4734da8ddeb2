"""The remote-loader server: loader specs, sampling, the worker pool and the gRPC service."""
