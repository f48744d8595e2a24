"""Reference models the tests check the core against (not shipped with the package)."""
