"""The daemon's lifecycle: start order, boot, reload, readiness, signals, drain and stop."""
