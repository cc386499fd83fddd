"""Tuned configuration tables (data), one JSON file per GPU slug, written by the tuning experiments."""
