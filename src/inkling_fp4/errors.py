"""Errors meant for the person at the command line.

A :class:`UserError` carries a one-line message that says what is wrong and how to fix it; the CLI
prints it and exits with code 2 (a full disk: 1), without a traceback. Anything else is a bug and
keeps its traceback.
"""

import errno

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
"""What an OSError says when the disk or the quota is full."""


class UserError(Exception):
    """A problem with the user's input (recipe, files, shapes, hardware request)."""

    exit_code = 2
    """What the command exits with: 2 for bad input; a full disk says 1 (nothing to fix in the input)."""


class ConfigError(UserError):
    """An invalid recipe, override or config value."""


class DataError(UserError):
    """A missing, empty or corrupt data source, shard or tokenizer."""


class NumericsError(UserError, ValueError):
    """A tensor the number formats cannot take: NaN/Inf, a bad shape or dtype."""


class DiskFullError(UserError):
    """No room on the disk (free space too small, or ENOSPC / EDQUOT while writing); whatever was being
    written is removed again, and what was there before is untouched."""

    exit_code = 1  # nothing is wrong with the command: free space, then run it again (or --resume)
