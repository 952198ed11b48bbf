"""GPU spawners: the controller handshake and the local process backend."""
