"""User-facing errors.

A StrataError is a problem with the user's input (a file, a flag, a tensor, a request
field). The CLI prints its message as one line and exits with code 2; no traceback.
Anything else that escapes is a bug in Strata.
"""


class StrataError(Exception):
    """One-line, user-facing error. The message names the culprit (file, tensor, flag)."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class OutOfMemory(StrataError):
    """The device (or host) had no room for what was being loaded: a pack's weights, a draft's,
    the slots' first KV blocks. A user-facing line like any StrataError (the message names what
    was being loaded: the pack, the tensor, the slots)."""


# The exit code of a process whose GPU lost its context (nothing more can run in it): the served
# engine (strata serve starts a new one) and `strata generate`
EXIT_DEVICE_LOST = 3
