"""The user-facing error, on the lowest floor because every package raises it (kernels included).

    KilnError      bad input anywhere (checkpoint, config, recipe, artifact, impossible request): exit 2

The CLI turns it into one line on stderr; anything else escaping is a bug and keeps its traceback. Exit 1
(a gate below its floor) is the optimizer's own: BelowFloor, in kiln.optimizer.errors.
"""


class KilnError(Exception):
    """A user-facing error: bad checkpoint, bad config, impossible request. The message is one line."""


def check_choice(field_name: str, value, allowed) -> None:
    """Refuse a config value outside its allowed set, in one line naming both (every package's validator)."""
    if value not in allowed:
        raise KilnError(f"{field_name}={value!r} is not allowed; choose one of {', '.join(map(str, allowed))}")


def clip(value: object, limit: int = 80) -> str:
    """`value` as one line of at most `limit` characters (control characters escaped, an ellipsis if cut),
    for putting something from a file or the command line into an error message."""
    text = str(value)
    if not text.isprintable():
        text = text.encode("unicode_escape", "backslashreplace").decode("ascii")
    return text if len(text) <= limit else text[: limit - 1] + "…"
