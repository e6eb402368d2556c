"""Importing the module ``orbit-sync worker MODULE:ATTRIBUTE`` names and finding its Worker: a
mistake in the module's configuration raised as such (one line, exit 2), any other failure
reported in one line that says where it happened (the traceback at DEBUG)."""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import sys
import sysconfig
import traceback
from typing import Any

from ._cli_report import report_error
from .client import SettingError

__all__ = ["Misuse", "load", "misuse"]

_LOG = logging.getLogger("orbit_sync.cli")


def load(target: str, module_name: str, attribute: str) -> Any:
    """The Worker *target* names (calling a factory), or None after printing why not. Raises
    :class:`SettingError` or :class:`Misuse` for a mistake in the module's configuration."""
    from .worker import Worker

    # Like `python -m`, let the current directory's modules be found.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        _failed(target, exc, module_name, f"cannot load {target}: ")
        return None
    try:
        for part in attribute.split("."):
            obj = getattr(obj, part)
    except AttributeError as exc:
        report_error(f"cannot load {target}: {exc}")
        return None
    if isinstance(obj, Worker):
        return obj
    if not callable(obj):
        report_error(f"{target} is a {type(obj).__name__}, not an orbit_sync.worker.Worker")
        return None
    if _needs_arguments(obj):
        report_error(
            f"{target} is a function that takes arguments (a handler?), not a Worker or a "
            "factory: point at the Worker the handler is registered on, or at a function "
            "without arguments that returns one"
        )
        return None
    try:
        made = obj()
    except Exception as exc:
        _failed(target, exc, module_name, f"cannot load {target}: {attribute}() raised ")
        return None
    if not isinstance(made, Worker):
        report_error(
            f"{target}() returned a {type(made).__name__}, not an orbit_sync.worker.Worker"
        )
        return None
    return made


class Misuse(ValueError):
    """orbit-sync refused what the worker module asked of it (a handler's ``time_limit=0``, a
    handler registered twice, ``capacity=0``): configuration, reported in one line, exit 2."""


#: The package's own directory: an error raised in there at import is the API refusing a value.
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def misuse(exc: BaseException) -> bool:
    """Whether *exc* is orbit-sync refusing a value it was given (a ``ValueError`` or
    ``TypeError`` raised inside the package), not a bug of the code that called it."""
    if not isinstance(exc, ValueError | TypeError):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(_PACKAGE)


def _failed(target: str, exc: Exception, module_name: str, prefix: str) -> None:
    """Report why importing the module (or calling its factory) failed: raise a mistake in its
    configuration, else print one line naming where (the traceback at DEBUG)."""
    if isinstance(exc, SettingError):
        raise exc
    if isinstance(exc, KeyError):
        _raise_unset_variable(exc)
    if misuse(exc):
        raise Misuse(str(exc)) from exc
    if isinstance(exc, ModuleNotFoundError) and _names_the_target(exc, module_name):
        report_error(f"{prefix}{exc}")  # a typo in the target: nothing of the module ran
        return
    where = "" if isinstance(exc, SyntaxError) else _where(exc, module_name)
    hint = "" if _LOG.isEnabledFor(logging.DEBUG) else "; --log-level DEBUG shows the traceback"
    report_error(f"{prefix}{type(exc).__name__}: {exc}{where}{hint}")
    _LOG.debug("the traceback of %s:", target, exc_info=exc)


def _names_the_target(exc: ModuleNotFoundError, module_name: str) -> bool:
    """The module not found is the target or one of its packages."""
    return bool(exc.name) and f"{module_name}.".startswith(f"{exc.name}.")


#: Where the interpreter's and the installed packages' files are: not the application's.
_LIBRARIES = tuple(
    {
        os.path.abspath(sysconfig.get_paths()[key]) + os.sep
        for key in ("stdlib", "platstdlib", "purelib", "platlib")
    }
)


def _where(exc: BaseException, module_name: str) -> str:
    """`` (FILE, line N, in FUNCTION)`` for the innermost frame of *exc* in the application's
    code (the module's package, or a file outside the interpreter's and the installed packages'),
    else for the innermost one; empty when the failure never reached a file of its own (a
    module not found)."""
    top = module_name.split(".")[0]
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename
        if not path.startswith("<") and not os.path.abspath(path).startswith(_PACKAGE):
            frames.append(tb)
        tb = tb.tb_next

    def own(tb: Any) -> bool:
        name = tb.tb_frame.f_globals.get("__name__", "")
        path = os.path.abspath(tb.tb_frame.f_code.co_filename)
        return name == top or name.startswith(f"{top}.") or not path.startswith(_LIBRARIES)

    # The import machinery's own frame (importlib.import_module) is never where it failed.
    frames = [tb for tb in frames if tb.tb_frame.f_globals.get("__name__") != "importlib"]
    if not frames:
        return ""
    chosen = next((tb for tb in reversed(frames) if own(tb)), frames[-1])
    path = chosen.tb_frame.f_code.co_filename
    relative = os.path.relpath(path)
    shown = path if relative.startswith(os.pardir) else relative
    function = chosen.tb_frame.f_code.co_name
    inside = "" if function == "<module>" else f", in {function}"
    return f" ({shown}, line {chosen.tb_lineno}{inside})"


def _raise_unset_variable(exc: KeyError) -> None:
    """Raise the module's own ``os.environ["ORBIT_..."]`` of a variable that is not set as a
    setting error (one line, exit 2, like ``Client.from_env()``'s) rather than a traceback."""
    name = exc.args[0] if len(exc.args) == 1 else None
    if isinstance(name, str) and name.startswith("ORBIT_") and name not in os.environ:
        raise SettingError(f"{name} is not set (the module reads os.environ[{name!r}])") from None


def _needs_arguments(fn: Any) -> bool:
    """True when *fn* cannot be called without arguments (e.g. a ``(ctx, payload)`` handler)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: let the call decide
        return False
    required = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return any(
        p.default is p.empty and (p.kind in required or p.kind is p.KEYWORD_ONLY)
        for p in signature.parameters.values()
    )
