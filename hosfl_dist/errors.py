"""Errors that the CLI turns into one-line messages."""


class HosflError(Exception):
    """Base of the errors the command line reports in one line, without a traceback."""

    exit_code = 2
    """The process exit code: 2 for bad input (the default), 1 for a run that failed while training."""


class ConfigError(HosflError, ValueError):
    """A configuration value is missing, unknown or invalid."""


class DataError(HosflError):
    """A data set cannot be found or read."""


class NonFiniteError(HosflError):
    """A non-finite activation, gradient, loss or scalar (``train.on_nonfinite=stop``): the run stops, failed."""

    exit_code = 1


class Interrupted(HosflError):
    """SIGTERM or SIGINT: the run checkpointed (where it could) and stopped; summary.json says ``interrupted``."""

    exit_code = 1


class ProtocolError(HosflError):
    """A client call the server refuses (fail closed): a client not sampled in the round, a malformed upload."""

    exit_code = 1
