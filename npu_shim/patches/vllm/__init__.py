"""Patches of vllm."""
