"""Surfaces: the command line, terminal rendering, reports."""
