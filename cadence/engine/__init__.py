"""The engine room: loop, event bus, state, config and the backend contract."""
