"""Patches of vllm_ascend."""
