"""Patches of sglang."""
