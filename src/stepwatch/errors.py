"""The one exception tree of stepwatch.

::

    StepwatchError
    ├── ConfigError                 invalid options, raised before anything is installed
    ├── ValidationError (ValueError)  a record breaks its schema; names the field and the rule
    │   └── UnsupportedSchemaVersion  a present `schema_version` stepwatch does not read
    └── ArtifactError (ValueError)  a file on disk cannot be read as what it claims to be;
                                    names the file and, where known, the line and the field

Reading code raises these; capture code never raises into user code (it logs and counts).
"""

from __future__ import annotations

__all__ = [
    "ArtifactError",
    "ConfigError",
    "StepwatchError",
    "UnsupportedSchemaVersion",
    "ValidationError",
]


class StepwatchError(Exception):
    """Base class of every error stepwatch raises on purpose."""


class ConfigError(StepwatchError, ValueError):
    """An option given to stepwatch is invalid."""


class ValidationError(StepwatchError, ValueError):
    """A record does not satisfy its schema.

    Attributes:
        field: the JSON path of the offending field (``$.rank``), or ``$`` for the whole record.
        rule: what the field must satisfy, in words.
    """

    def __init__(self, field: str, rule: str) -> None:
        self.field = field
        self.rule = rule
        super().__init__(f"{field}: {rule}")


class UnsupportedSchemaVersion(ValidationError):
    """`schema_version` is present but is not a version stepwatch reads (no legacy fallback)."""


class ArtifactError(StepwatchError, ValueError):
    """An artifact cannot be read.

    Attributes:
        path: the file.
        line: 1-based line number for line-oriented files, else ``None``.
        field: the offending field when the record was parsed, else ``None``.
    """

    def __init__(
        self, path: object, reason: str, *, line: int | None = None, field: str | None = None
    ) -> None:
        self.path = str(path)
        self.line = line
        self.field = field
        self.reason = reason
        where = self.path if line is None else f"{self.path}:{line}"
        super().__init__(f"{where}: {reason}")
