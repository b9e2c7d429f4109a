"""What a user hands the command line, checked before it is used: text that must be UTF-8, paths whose bytes
are not (a file system takes any), and files that must be regular ones."""

from __future__ import annotations

import bz2
import gzip
import lzma
import os
import re
import stat
import sys
from typing import IO

from ._core import MAX_INPUT_FILE_BYTES, ScenarioError


# Characters a terminal acts on rather than shows: C0 controls (ESC starts a sequence that can move the cursor,
# retitle the window or rewrite what was printed), DEL and C1 controls (U+009B is a one-character CSI).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
# The same, less the line breaks and tabs of a multi-line text.
_CONTROL_IN_TEXT = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _escape(m: re.Match) -> str:
    return f"\\x{ord(m.group()):02x}"


def shown(text: str | os.PathLike) -> str:
    """`text` as printed within a line: bytes that are not UTF-8 (a path's or an argument's, which Python holds
    as lone surrogates, os.fsdecode) and control characters (a terminal's escape sequences, a line break) as
    \\xNN escapes, so that any stream can print it and it stays one item of one line."""
    try:
        s = os.fsencode(text).decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate no file system decoding makes (JSON's "\\ud800")
        s = os.fspath(text).encode("utf-8", "backslashreplace").decode("ascii")
    return _CONTROL.sub(_escape, s)


def terminal(text: str) -> str:
    """A command's text output as it reaches a terminal: what a trace or a sysfs tree named (a phase, a device,
    a host) is shown, never acted on: control characters but line breaks and tabs as \\xNN escapes, as
    `shown` escapes bytes that are not UTF-8."""
    return _CONTROL_IN_TEXT.sub(_escape, text)


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


def toml_text(path: str | os.PathLike, what: str = "a TOML file") -> str:
    """The text of a TOML file the user names (a sweep, a targets file, a profile): a regular file (a FIFO or a
    device is refused before it is opened) of at most MAX_INPUT_FILE_BYTES, as the core reads scenarios, in
    UTF-8 (an error names the line of the first byte that is not)."""
    name = shown(path)
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ScenarioError(f"{name}: {file_kind(st.st_mode)}; expected {what}")
        with open(path, "rb") as f:
            data = f.read(MAX_INPUT_FILE_BYTES + 1)
    except OSError as e:
        raise ScenarioError(f"{name}: cannot open: {e.strerror or e}") from None
    if len(data) > MAX_INPUT_FILE_BYTES:
        raise ScenarioError(f"{name}: larger than {MAX_INPUT_FILE_BYTES} bytes; expected {what}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ScenarioError(f"{name}:{line}: not UTF-8 text (byte {e.start}: {e.reason})") from None


def open_trace(path: str | os.PathLike) -> tuple[IO[bytes], IO[bytes] | None]:
    """The trace's bytes, and the file under them (whose position is the progress; None for stdin): '-' is
    standard input; .xz, .gz and .bz2 files are decompressed on the fly. Any other path must name a regular
    file: a device (/dev/zero), a directory or a FIFO is refused before it is opened (a pipe comes in as -).
    How much of a line is buffered is bounded where the lines are cut, in the core."""
    p = os.fspath(path)
    if p == "-":
        return sys.stdin.buffer, None
    opener = {".xz": lzma.open, ".lzma": lzma.open, ".gz": gzip.open, ".bz2": bz2.open}.get(os.path.splitext(p)[1])
    try:
        mode = os.stat(p).st_mode
        if not stat.S_ISREG(mode):
            raise ScenarioError(f"{shown(p)}: {file_kind(mode)}; expected a trace file (ftrace text, or .xz/.gz/.bz2) "
                                "or - for standard input")
        raw = open(p, "rb")
    except OSError as e:
        raise ScenarioError(f"{shown(p)}: cannot open: {e.strerror or e}") from None
    return (opener(raw, "rb") if opener else raw), raw
