"""Patches of transformers."""
