"""Decoding what comes from outside (files, HTTP bodies, frames) into the documented errors.

Every decoder stepwatch uses recurses once per nesting level, so a document nested deeper than
the interpreter's recursion limit (an export of a few hundred kB nested 100,000 levels deep)
makes it raise ``RecursionError``, and bytes that are not UTF-8 make msgspec raise
``UnicodeDecodeError``; neither is a ``msgspec.DecodeError``. Readers catch ``DECODE_FAILURES``
(or call ``decode_json_file``) so that such input is refused like any other malformed input,
with the error their contract documents (``ArtifactError`` naming the file, a counted
``TransportError`` reason, an HTTP 400), never a traceback.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from .errors import ArtifactError

__all__ = ["DECODE_FAILURES", "decode_json_file", "read_json_file", "undecodable"]

# msgspec.ValidationError is a DecodeError: callers that decode into a type and translate its
# field errors catch it before these.
DECODE_FAILURES: tuple[type[BaseException], ...] = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)
_any = msgspec.json.Decoder()


def undecodable(exc: BaseException) -> str:
    """Why a decoder refused its input, in words (a RecursionError says nothing useful)."""
    if isinstance(exc, RecursionError):
        return "nested too deeply (more levels than any decoder follows)"
    return str(exc)


def decode_json_file(
    data: bytes | bytearray | memoryview | str,
    path: str | os.PathLike[str],
    *,
    decoder: Any = _any,
    what: str = "not valid JSON",
    line: int | None = None,
) -> Any:
    """``decoder.decode(data)``, or ArtifactError("<what>: <why>") naming ``path`` (and ``line``).

    A ``msgspec.ValidationError`` of a typed ``decoder`` is re-raised as is, for the caller to
    name the field.
    """
    try:
        return decoder.decode(data)
    except msgspec.ValidationError:
        raise
    except DECODE_FAILURES as exc:
        raise ArtifactError(path, f"{what}: {undecodable(exc)}", line=line) from None


def read_json_file(path: str | os.PathLike[str], *, what: str = "not valid JSON") -> Any:
    """The JSON document in ``path``; ArtifactError naming it when it cannot be read or decoded."""
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as exc:
        raise ArtifactError(path, f"cannot read: {exc.strerror}") from exc
    return decode_json_file(data, path, what=what)
