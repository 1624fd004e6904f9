"""Adapters that let other tools drive quill (each imports its tool only when used)."""
