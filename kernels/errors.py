"""The one exception type for bad input anywhere in Kiln.

It lives on the lowest floor so that every package can raise it without importing upward. The CLI turns
it into a one-line message and exit code 2; anything else escaping is a bug and keeps its traceback.
"""


class KilnError(Exception):
    """A user-facing error: bad checkpoint, bad config, impossible request. The message is one line."""
