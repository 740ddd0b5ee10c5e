"""In-process capture: identity of the process within its job, collectors, scopes, runtime."""
