"""The errors a user can cause. Every layer raises these; the command line turns a
`ConfigError` into one sentence on standard error and exit status 2."""

from __future__ import annotations


class ConfigError(ValueError):
    """A mistake in the user's configuration or command line (exit status 2)."""
