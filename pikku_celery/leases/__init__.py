"""Leases: fenced, renewable ownership of a key (step leases, run leases)."""
