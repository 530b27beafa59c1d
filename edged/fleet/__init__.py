"""A fleet of devices: signed model bundles (``bundle``, ``signing``, ``trust``) and the agent
that rolls them out. ``edged.config`` imports ``edged.fleet.config``, so this file imports nothing."""
