"""What a user hands the command line, checked before it is used: text that must be UTF-8, paths whose bytes
are not (a file system takes any), and files that must be regular ones."""

from __future__ import annotations

import os
import stat

from ._core import ScenarioError


def shown(text: str | os.PathLike) -> str:
    """`text` as printed: bytes that are not UTF-8 (a path's or an argument's, which Python holds as lone
    surrogates, os.fsdecode) as \\xNN escapes, so that any stream can print it."""
    return os.fsencode(text).decode("utf-8", "backslashreplace")


def utf8(text: str, what: str) -> str:
    """`text`, or a ScenarioError naming `what` and the text when it holds bytes that are not UTF-8 (the core
    takes UTF-8 text only)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ScenarioError(f"{what} {shown(text)}: bytes that are not UTF-8; expected UTF-8 text") from None
    return text


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, for an error (`mode`: st_mode)."""
    kinds = [(stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")]
    return next((name for test, name in kinds if test(mode)), "not a regular file")
