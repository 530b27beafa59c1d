"""The commands beside the daemon: top, plan and build, selftest, the demo models."""
