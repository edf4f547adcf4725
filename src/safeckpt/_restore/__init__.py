"""Choosing the checkpoint to load and loading it (into a template, or without one)."""
