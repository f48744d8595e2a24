"""kvadmit_patches: the engine changes no plugin hook reaches.

Each module is one small patch for one engine version, applied at run time by
kvadmit's adapter (never by editing site-packages), with `TARGET` naming the
patched object, `VERSIONS` the engine versions it was written and tested
against, and `apply()` refusing any other version. See patches/README.md.
"""


def wrap(owner, name: str, make_wrapper) -> None:
    """Replaces ``owner.<name>`` by ``make_wrapper(original)``, once per patch: a second
    call with the same `make_wrapper` finds its mark in the chain of wrappers and leaves
    it (patches are applied in every process, maybe twice); another patch may wrap the
    same target on top."""
    original = getattr(owner, name)
    mark = f"{make_wrapper.__module__}.{make_wrapper.__qualname__}"
    fn = original
    while fn is not None:
        if getattr(fn, "__kvadmit_patch__", None) == mark:
            return
        fn = getattr(fn, "__wrapped__", None)
    wrapper = make_wrapper(original)
    wrapper.__kvadmit_patch__ = mark
    wrapper.__wrapped__ = original
    wrapper.__doc__ = original.__doc__
    setattr(owner, name, wrapper)


def add_app_middleware(middleware) -> None:
    """Adds the ASGI `middleware` to vLLM's API server app where vLLM adds its own
    (init_entrypoints_middleware, when the app is built), once per middleware."""
    import vllm.entrypoints.launchers.app as app_module

    def make(original):
        def init_entrypoints_middleware(args, app, *rest, **kwargs):
            result = original(args, app, *rest, **kwargs)
            app.add_middleware(middleware)
            return result
        return init_entrypoints_middleware

    # wrap's once-mark is the maker's name: the middleware's patch module, one per middleware.
    make.__module__ = middleware.__module__
    make.__qualname__ = f"{make.__qualname__}[{middleware.__qualname__}]"
    wrap(app_module, "init_entrypoints_middleware", make)
