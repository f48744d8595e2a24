"""kvadmit_patches: the engine changes no plugin hook reaches.

Each module is one small patch for one engine version, applied at run time by
kvadmit's adapter (never by editing site-packages), with `TARGET` naming the
patched object, `VERSIONS` the engine versions it was written and tested
against, and `apply()` refusing any other version. See patches/README.md.
"""


def wrap(owner, name: str, make_wrapper) -> None:
    """Replaces ``owner.<name>`` by ``make_wrapper(original)``, once: a second call
    finds the mark and leaves it (patches are applied in every process, maybe twice)."""
    original = getattr(owner, name)
    if getattr(original, "__kvadmit_patch__", False):
        return
    wrapper = make_wrapper(original)
    wrapper.__kvadmit_patch__ = True
    wrapper.__wrapped__ = original
    wrapper.__doc__ = original.__doc__
    setattr(owner, name, wrapper)
