"""Integrations with web frameworks (imported only on demand: neither is a dependency)."""
