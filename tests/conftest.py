"""Test-wide settings."""

import os

# Loads in tests neither read nor write the prepacked cache (~/.cache/quill) unless a test asks for it
# (tests/test_prepacked.py): a kernel a test patches must not meet a layout an earlier run cached.
os.environ["QUILL_CACHE"] = "0"
