"""The error of a configuration value mlora cannot run with (one class for every check of the config)."""


class ConfigError(ValueError):
    """A configuration value that mlora cannot run with; the message names the key."""
