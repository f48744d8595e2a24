"""kvadmit_patches: the engine changes no plugin hook reaches.

Each module is one small patch, applied at run time by kvadmit's adapter (never by
editing site-packages). It declares the engine release series it supports
(`SERIES`: any patch or point release of one, 0.33.2 as 0.33.0) and what it wraps
or calls (`TARGETS`: each object, with the parameters its wrapper relies on), and its
`apply()` checks both against the installed engine first (`require`): a series it does
not support, or a target that moved or changed its signature, raises
`PatchUnavailable` naming each problem, and nothing is patched. See patches/README.md.
"""
import importlib
import inspect
import sys
from dataclasses import dataclass


class PatchUnavailable(RuntimeError):
    """A patch cannot apply to the installed engine; `problems` says why."""

    def __init__(self, patch: str, problems: list[str]):
        super().__init__(f"{patch}: " + "; ".join(problems))
        self.patch, self.problems = patch, problems


@dataclass(frozen=True)
class Target:
    """An engine object a patch wraps or calls: "module:Attr.path" (a module alone
    without the colon), the leading parameters its wrapper passes on by name or
    position, and whether the wrapper needs an async generator function."""
    path: str
    params: tuple[str, ...] = ()
    async_gen: bool = False

    def problems(self) -> list[str]:
        module, _, attr = self.path.partition(":")
        label = f"{module}.{attr}" if attr else module
        try:
            obj = importlib.import_module(module)
            for name in filter(None, attr.split(".")):
                obj = getattr(obj, name)
        except Exception as e:   # noqa: BLE001 - ImportError, AttributeError, ...
            return [f"{label} is missing ({type(e).__name__}: {e})"]
        found = []
        if self.params:
            try:
                names = tuple(inspect.signature(obj).parameters)
            except (TypeError, ValueError) as e:   # no longer a function with a signature
                return [f"{label} has no signature to check ({type(e).__name__}: {e})"]
            if names[:len(self.params)] != self.params:
                found.append(f"{label}({', '.join(names)}) does not start with the "
                              f"parameters the wrapper needs ({', '.join(self.params)})")
        if self.async_gen and not inspect.isasyncgenfunction(obj):
            found.append(f"{label} is no longer an async generator function")
        return found


def series(version: str) -> str:
    """'0.33' for '0.33.0', '0.33.1rc2', '0.33.0+cpu'."""
    return ".".join(version.split("+")[0].split(".")[:2])


def problems(patch, version: str | None = None) -> list[str]:
    """Why `patch` (a patch module) cannot apply to the installed vLLM, [] when it
    can: its series (of `version`, by default the installed one's), then each target."""
    if version is None:
        import vllm
        version = str(vllm.__version__)
    found = [] if series(version) in patch.SERIES else [
        f"vLLM {version} is not a series it supports "
        f"({', '.join(s + '.x' for s in patch.SERIES)})"]
    for target in patch.TARGETS:
        found += target.problems()
    return found


def require(patch_name: str) -> None:
    """Raises PatchUnavailable unless the patch module `patch_name` can apply."""
    found = problems(sys.modules[patch_name])
    if found:
        raise PatchUnavailable(patch_name.rsplit(".", 1)[-1], found)


def wrap(owner, name: str, make_wrapper) -> None:
    """Replaces ``owner.<name>`` by ``make_wrapper(original)``, once per patch: a second
    call with the same `make_wrapper` finds its mark in the chain of wrappers and leaves
    it (patches are applied in every process, maybe twice); another patch may wrap the
    same target on top."""
    if wrapped_by(owner, name, make_wrapper):
        return
    original = getattr(owner, name)
    wrapper = make_wrapper(original)
    wrapper.__kvadmit_patch__ = _mark(make_wrapper)
    wrapper.__wrapped__ = original
    wrapper.__doc__ = original.__doc__
    setattr(owner, name, wrapper)


def _mark(make_wrapper) -> str:
    return f"{make_wrapper.__module__}.{make_wrapper.__qualname__}"


def wrapped_by(owner, name: str, make_wrapper) -> bool:
    """Whether ``owner.<name>`` is wrapped by `wrap` with `make_wrapper` (anywhere in its
    chain of wrappers)."""
    fn = getattr(owner, name)
    while fn is not None:
        if getattr(fn, "__kvadmit_patch__", None) == _mark(make_wrapper):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


# Where add_app_middleware hooks in: vLLM calls it as (args, app, ...) once it has built
# the API server's app.
MIDDLEWARE_HOOK = Target("vllm.entrypoints.launchers.app:init_entrypoints_middleware",
                         ("args", "app"))


def add_app_middleware(middleware, options=None) -> None:
    """Adds the ASGI `middleware` to vLLM's API server app where vLLM adds its own
    (init_entrypoints_middleware, when the app is built), once per middleware;
    ``options(args)``, if given, makes its keyword arguments from the server's."""
    import vllm.entrypoints.launchers.app as app_module

    def make(original):
        def init_entrypoints_middleware(args, app, *rest, **kwargs):
            result = original(args, app, *rest, **kwargs)
            app.add_middleware(middleware, **(options(args) if options is not None else {}))
            return result
        return init_entrypoints_middleware

    # wrap's once-mark is the maker's name: the middleware's patch module, one per middleware.
    make.__module__ = middleware.__module__
    make.__qualname__ = f"{make.__qualname__}[{middleware.__qualname__}]"
    wrap(app_module, "init_entrypoints_middleware", make)
