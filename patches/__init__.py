"""kvadmit_patches: the engine changes no plugin hook reaches.

Each module is one small patch for one engine version, applied at run time by
kvadmit's adapter (never by editing site-packages), with `TARGET` naming the
patched object, `VERSIONS` the engine versions it was written and tested
against, and `apply()` refusing any other version. See patches/README.md.
"""
