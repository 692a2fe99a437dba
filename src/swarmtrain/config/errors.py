"""Exceptions for user mistakes; the CLI prints their one-line message and exits with code 2."""


class UserError(Exception):
    """Something the user can fix (bad flag, missing file, malformed input). Never shown as a traceback."""


class ConfigError(UserError, ValueError):
    """A bad field, value, preset or config file. The message names what is wrong."""
