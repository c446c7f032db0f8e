"""Helpers that start and reach the real services tests run against."""
