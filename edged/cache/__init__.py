"""The engine cache: keys, manifests, locks, atomic writes, quarantine, and collection."""
