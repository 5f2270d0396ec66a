"""Backends adapt the loop to a distribution strategy; see `cadence.engine.backend`."""
