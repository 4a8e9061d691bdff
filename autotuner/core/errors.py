"""One error hierarchy. The CLI turns each into a one-line message and an exit code."""

# Where each rank records its uncaught exception (launch/elastic.py sets it; rank_setup.py reads it).
# Here rather than in boundary.py so that `import autotuner` stays light: the launcher's stop
# handler goes in only once the package is imported (app/entry.py).
ERROR_DIR_ENV = "AUTOTUNER_ERROR_DIR"


class RecordError(ValueError):
    """A record file that is missing fields, damaged, or from another version."""


class AutotunerError(Exception):
    """Base of every error we raise on purpose. `exit_code` is what the CLI returns."""

    exit_code = 1


class UsageError(AutotunerError):
    """Bad command line: a flag, a missing file, a value out of range."""

    exit_code = 2


class ConfigError(AutotunerError):
    """The DeepSpeed-style config is malformed or inconsistent.

    The message names the file or dotted key, the bad value and what is allowed.
    """

    exit_code = 2


class UnsupportedError(ConfigError):
    """A valid config that cannot work on this device or torch version."""


class LaunchError(AutotunerError):
    """Ranks could not be started, or failed."""

    exit_code = 1
