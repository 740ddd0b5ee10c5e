"""Pure analysis over loaded telemetry: the same functions serve the CLI, reports and live views."""
