"""Exceptions the CLI maps to one-line messages and exit codes (see `minicpm_cli.cli.app.main`)."""

from __future__ import annotations

from .protocol import not_unicode


class MinicpmError(Exception):
    """A problem the user can act on: printed as one line, exit status `exit_code`."""

    exit_code = 1


class UsageError(MinicpmError):
    """Invalid options or input (empty text, unknown format, ...)."""


class OptionError(UsageError):
    """Options that cannot go together, or an option's value out of its range: a usage error like the
    parser's own, exit status 2."""

    exit_code = 2


class VoiceError(UsageError):
    """A reference voice that cannot be used: unreadable, not audio, too long or short, silent."""


class ModelNotFound(MinicpmError):
    """A model directory or hub repository that cannot be found or reached."""


class CheckpointError(MinicpmError):
    """A checkpoint that exists but cannot be read: truncated file, missing or misshapen tensor."""


class BackendError(MinicpmError):
    """Unknown backend, a missing optional dependency, or a backend that failed to start."""


class UnknownBackend(BackendError, OptionError):
    """A backend name that is not in the registry: an option's value out of its range (exit 2)."""


class DeviceError(MinicpmError):
    """The requested device or dtype is not available here."""


def unicode_text(text: str, where: str) -> str:
    """`text`, or a UsageError where it is not Unicode text (`protocol.not_unicode`: the CLI's input and
    the Python API's both; the server answers the same message as a 400)."""
    problem = not_unicode(text, where)
    if problem:
        raise UsageError(problem)
    return text
