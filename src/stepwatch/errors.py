"""The one exception tree of stepwatch.

::

    StepwatchError
    ├── ConfigError                 invalid options, raised before anything is installed
    ├── IntegrationUnavailable (ImportError)  a framework integration's library is missing or too old
    ├── ValidationError (ValueError)  a record breaks its schema; names the field and the rule
    │   └── UnsupportedSchemaVersion  a present `schema_version` stepwatch does not read
    ├── StoreError                  the history store cannot be opened, written or queried
    ├── TransportError              a frame or HTTP body cannot be accepted; says why
    └── ArtifactError (ValueError)  a file on disk cannot be read as what it claims to be;
                                    names the file and, where known, the line and the field

Reading code raises these; capture code never raises into user code (it logs and counts).
"""

from __future__ import annotations

__all__ = [
    "ArtifactError",
    "ConfigError",
    "IntegrationUnavailable",
    "StepwatchError",
    "StoreError",
    "TransportError",
    "UnsupportedSchemaVersion",
    "ValidationError",
]


class StepwatchError(Exception):
    """Base class of every error stepwatch raises on purpose."""


class ConfigError(StepwatchError, ValueError):
    """An option given to stepwatch is invalid."""


class IntegrationUnavailable(StepwatchError, ImportError):
    """A ``stepwatch.capture.integrations`` module cannot work: its library is missing or too old.

    Attributes:
        library: the distribution that is missing or too old (``transformers``, ``lightning``).
    """

    def __init__(self, library: str, reason: str) -> None:
        self.library = library
        super().__init__(f"{library}: {reason}", name=library)


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


class StoreError(StepwatchError):
    """The history store failed; the message names the store."""


class TransportError(StepwatchError, ValueError):
    """A frame or request body was rejected.

    Attributes:
        reason: a short machine-readable reason (``oversize``, ``not_msgpack``, ``bad_shape``...).
    """

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        super().__init__(f"{reason}: {detail}")


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
