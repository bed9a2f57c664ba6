"""Helpers the patches share; imported only by family code, once a target module is.

    structure     what the checks read of a target's structure: a module's class, a class's own
                  function, the digest of a body a replacement was written from; a class's own
                  function replaced and presented in one call (:func:`structure.replace_own`),
                  the one the check found and returned (``context.found``) where it did
    code          what a function's code says: the names it refers to (one scanner, own code or
                  nested code too) and its source with the white space folded
    host_record   the host lengths kept on a device tensor, and the hook that keeps them at a host
                  tensor's next copy (``vllm.mm_encoder_host_lengths`` and the tower patches)
    host_data     what counts as host data (on ``cpu`` with no index: never a device stand-in), a
                  host grid, host integers, and the ``cu_seqlens`` towers build from a grid
    transient     state hung on upstream's tensors and layers that never travels with them

Nothing here names a patch: a family gets its patch's name, counters and the one way to
present a replacement from its :class:`~npu_shim.patch.FamilyContext`.
"""
