"""Errors that the CLI turns into one-line messages."""


class HosflError(Exception):
    """Base of the errors the command line reports in one line, without a traceback."""


class ConfigError(HosflError, ValueError):
    """A configuration value is missing, unknown or invalid."""


class DataError(HosflError):
    """A data set cannot be found or read."""
