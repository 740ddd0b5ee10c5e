"""Feeds in other tools' formats, built from the history: the Perfetto / Chrome trace
(``perfetto``). docs/export.md."""
