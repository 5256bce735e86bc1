"""The stream server (HTTP API, rooms, transports). Imports states, engine and pipelines."""
