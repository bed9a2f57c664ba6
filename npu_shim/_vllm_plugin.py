"""vLLM ``vllm.general_plugins`` entry point.

vLLM loads general plugins in every process it starts (API server, engine
core, workers, Ray workers), so registering here installs the shim in all of
them even when PYTHONPATH does not carry the bootstrap directory. By the time
vLLM calls this, ``vllm`` is imported: the machinery loads at once and patches
targets that are already imported on the spot.
"""


def register():
    import npu_shim

    npu_shim.install()
