"""Local artifacts every rank writes even with no aggregator: the crash-safe record of a run."""
