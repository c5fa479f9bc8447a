"""Helpers that more than one test package uses; a helper one package alone uses stays in that package."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
