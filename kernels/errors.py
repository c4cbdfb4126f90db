"""The exceptions that carry Kiln's exit codes, on the lowest floor so every package can raise them.

    KilnError      bad input anywhere (checkpoint, config, recipe, artifact, impossible request): exit 2
    BelowFloor     a gate measured the artifact below its floor (or --strict met a reverted pass): exit 1

The CLI turns both into one line on stderr; anything else escaping is a bug and keeps its traceback.
"""


class KilnError(Exception):
    """A user-facing error: bad checkpoint, bad config, impossible request. The message is one line."""


class BelowFloor(Exception):
    """An accuracy floor was not met. The message is one line."""


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
