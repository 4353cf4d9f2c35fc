"""Paths of the repository the tests read (docs, deploy files, benchmark scripts)."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The checkout's root: this file is tests/support/paths.py."""
