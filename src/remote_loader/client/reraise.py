"""A server-side exception raised in the training loop as its own type, as torch's DataLoader
raises a worker's (`ExceptionWrapper.reraise` in torch/_utils.py), and as this client's too.

NOTE [ Remote exception types ]

The server names the class of an exception that failed a batch, or broke the loader
(CapturedError.module and .qualname). The client raises an instance of a class made here, once
per (original class, client error class):

    class ValueError(builtins.ValueError, _Typed<DatasetError>): ...

so `except ValueError` and `except DatasetError` both catch it. As torch does, it is built with
the message as its one argument (KeyError's wrapped so that str() does not quote it; a class
with a `message` attribute given message=...); a class that cannot be built so, or subclassed,
gives one that is a RuntimeError instead, as torch raises RuntimeError then, and so does a
StopIteration (raised from next(), it would end the loop silently: PEP 479's rule). The
original class is found by importing its module by name, as unpickling it would; one that
cannot be found so (a module this side lacks, a class local to a function, no names: a server
from before them) is the caller's to fall back from (client/errors.py: the plain error).
"""

from __future__ import annotations

import functools
import importlib
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

E = TypeVar("E", bound=Exception)


@functools.lru_cache(maxsize=256)
def original_class(module: str, qualname: str) -> type[Exception] | None:
    """The class `module`.`qualname` names, when this side has it and it is an Exception."""
    if not module or not qualname:
        return None
    try:
        found: Any = sys.modules.get(module) or importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except Exception:
        return None
    return found if isinstance(found, type) and issubclass(found, Exception) else None


def torch_message(original: type[Exception], where: str, traceback: str) -> str:
    """torch's message for a worker's exception: "Caught ValueError in DataLoader worker
    process 0.\\nOriginal Traceback (most recent call last): ..."."""
    return f"Caught {original.__name__} {where}.\nOriginal {traceback}"


def raise_as(original: type[Exception], base: type[E], message: str, rebuild: tuple[Any, ...]) -> E:
    """An exception that is an `original` and a `base`, made from `message` as torch makes a
    worker's exception (NOTE [ Remote exception types ]). `rebuild` is what pickling it gives:
    (a function, its arguments), since its class is made at run time, not importable."""
    typed: Callable[..., E] | None = _typed_class(original, base)
    exc: E
    try:
        if typed is None:
            raise TypeError(f"{original.__qualname__} cannot be subclassed")
        if issubclass(original, StopIteration | StopAsyncIteration):
            # Raised from next(), it would end the training loop's `for` as if the epoch had:
            # a RuntimeError instead, as Python makes of one raised in a generator (PEP 479).
            raise TypeError("a StopIteration cannot be raised from next()")
        if original is KeyError:
            exc = typed(_KeyErrorMessage(message))
        elif getattr(original, "message", None):
            exc = typed(message=message)  # torch's rule for such classes
        else:
            exc = typed(message)
    except Exception:
        # Not made from one message (it takes more arguments, or its __init__ failed): torch
        # raises RuntimeError(msg) then. RuntimeError is always subclassable.
        runtime = _typed_class(RuntimeError, base)
        if runtime is None:  # never: RuntimeError and a client error combine
            raise
        exc = runtime(message)
    exc.__dict__["_rebuild"] = rebuild
    return exc


class _KeyErrorMessage(str):
    """A message whose repr is itself: KeyError's str() is the repr of its argument, which
    would print the whole traceback on one line, quoted (torch's KeyErrorMessage)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return self


def _init(self: Exception, *args: Any) -> None:
    # Built with the message alone, as the original is: an original __init__ that calls
    # super().__init__(message) lands here, past the base's own signature.
    Exception.__init__(self, *args)


def _reduce(self: Exception) -> tuple[Any, ...]:
    rebuild: tuple[Any, ...] = self.__dict__["_rebuild"]
    return rebuild


# The classes made (None: refused), one per (original, base): two errors of one type are of
# one class, as with torch. A lock: receivers of several loaders may meet one type at once.
_TYPED: dict[tuple[type[Exception], type[Exception]], Any] = {}
_SHIMS: dict[type[Exception], type[Exception]] = {}
_LOCK = threading.Lock()


def _typed_class(original: type[Exception], base: type[E]) -> type[E] | None:
    """A class that is both `original` and `base`, named and shown as `original` (a traceback
    prints "ValueError: Caught ValueError ..." as torch's does); None when Python refuses the
    combination (a class that forbids subclassing, or a clashing layout)."""
    with _LOCK:
        key = (original, base)
        if key not in _TYPED:
            shim = _SHIMS.get(base)
            if shim is None:
                shim = _SHIMS[base] = type(
                    f"_Typed{base.__name__}",
                    (base,),
                    {"__init__": _init, "__module__": __name__},
                )
            bases = (shim,) if issubclass(shim, original) else (original, shim)
            namespace = {
                "__module__": original.__module__,
                "__qualname__": original.__qualname__,
                "__reduce__": _reduce,  # before the original's own (OSError has one)
            }
            try:
                _TYPED[key] = type(original.__name__, bases, namespace)
            except TypeError:
                _TYPED[key] = None
        typed: type[E] | None = _TYPED[key]
        return typed
