"""The remote-loader client."""
