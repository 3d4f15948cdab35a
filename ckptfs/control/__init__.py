"""Both ends of the admin socket: the client the CLI and the Python API call (client) and the
daemon's server that dispatches to its handlers (server)."""
