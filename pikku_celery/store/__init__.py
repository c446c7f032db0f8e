"""Workflow stores: where runs, steps, attempt history and versions live."""
