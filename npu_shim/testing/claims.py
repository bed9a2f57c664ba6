"""What a patch's declaration claims for the installed release, for tests to expect.

A lane test that kept its own ``{vLLM minor: family}`` map could drift from the
declaration it checks and still pass; these read the same data the lane gate
reads (the status row's ``admitted``: the families whose fence admits the
installed versions), so adding a lane to a test's marker is all it takes.
"""


def status_row(patch_name):
    import npu_shim

    return next(row for row in npu_shim.status() if row["name"] == patch_name)


def declaration(patch_name):
    """The patch's ``PATCH`` declaration (its module imported, not applied)."""
    import importlib

    from npu_shim.patches import BUILTIN_PATCHES

    return importlib.import_module(dict(BUILTIN_PATCHES)[patch_name]).PATCH


def claimed_family(patch_name):
    """The one family whose fence admits the installed release, or None where none does
    (outside the patch's window). Two admitting families would make a release's family
    ambiguous, which the declaration must not do."""
    admitted = status_row(patch_name)["admitted"]
    assert len(admitted) <= 1, "%s: fences overlap at the installed release: %s" % (patch_name, admitted)
    if not admitted:
        return None
    return next(family for family in declaration(patch_name).families if family.name == admitted[0])

