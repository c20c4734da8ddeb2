"""The classes a batch's header names (namedtuples, dataclasses, Mappings), found on the client
and rebuilt from their decoded fields, or a stand-in with a warning where they cannot be.

NOTE [ Batch types ]

torch's default_collate keeps a namedtuple's type, and a collate_fn may return a dataclass, a
Mapping subclass or a PackedSequence (a namedtuple). The header names such a class, and the
client rebuilds the batch as that class when it has it:

    server (encoding.py)                      client (here)
    namedtuple    -> Sequence(type, fields)   cls(*items)       cls: a tuple subclass, same _fields
    dataclass     -> Mapping(type), keys =    cls(**fields)     cls: a dataclass
                     its fields (init=True)
    Mapping that  -> Mapping(type)            cls() + update()  cls: a MutableMapping subclass
    is no dict                                cls(dict)         cls: another Mapping subclass
    dict, tuple   -> type "" (as before)      dict, tuple       (fields of an old header)

`type` is "module:qualname". The class is found by `importlib.import_module(module)` and getattr
along `qualname`, once per type (cached); nothing else is looked up or run, and nothing is
unpickled: the only code that runs is the import of a module installed here (its top-level
code, as any import runs it) and the constructor of a class that passed the check above (the
call default_collate itself makes). A class whose qualname has `<locals>`, one of `__main__` or
`__mp_main__` (the server's script is not the trainer's), one not importable here, one that
fails the check, or a constructor that raises: the batch arrives as a stand-in instead, a
namedtuple of the same name and fields made here (cached per type and fields) or a plain dict,
and a UserWarning names the type, once per type, with what to do (make the module importable on
the trainer).

Rules kept small on purpose:
- Only a tuple subclass with `_fields` is a namedtuple; another (torch.Size, a structseq such as
  torch.return_types.max) travels as a plain tuple, and a list subclass as a list.
- A Mapping is rebuilt from its items alone: a defaultdict comes back with default_factory None
  (the factory is code, and code is not sent), an attribute of a dict subclass is lost. A
  dataclass field with init=False is refused when encoding (EncodeError): __init__ could not
  set it.
- A dict key stays a plain tuple even if it was a namedtuple (it hashes and compares the same).
- A PackedSequence decoded onto a device keeps `batch_sizes` on the CPU (a small copy), as
  PackedSequence.to() keeps it and as its constructor requires (CPU_FIELDS).
A decoder that predates these fields ignores them: it gives plain tuples and dicts, as before.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib
import keyword
import warnings
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

# Distinct type names whose lookups are cached: a server names a handful; the bound only keeps a
# misbehaving one from growing the caches without end.
CACHED_TYPES = 1024
# Namedtuple fields that stay on the CPU when the batch is decoded onto a device, as the class
# keeps them there (NOTE [ Batch types ]).
CPU_FIELDS = {"torch.nn.utils.rnn:PackedSequence": frozenset({"batch_sizes"})}
_NOT_IMPORTABLE_MODULES = ("__main__", "__mp_main__")

_Found = type | str  # the class a header names, or why there is none here
_Rebuild = Callable[[dict[Any, Any]], Any]


def _find_class(type_name: str) -> _Found:
    """The class `type_name` ("module:qualname") names here: an import and attribute lookups,
    nothing else (NOTE [ Batch types ])."""
    module, _, qualname = type_name.partition(":")
    parts = qualname.split(".")
    if "<locals>" in parts:
        return "it is defined inside a function (<locals>); define it at module level"
    if module in _NOT_IMPORTABLE_MODULES:
        return f"it is defined in the server's {module} script, which the trainer does not run"
    names = [*module.split("."), *parts]
    if not all(name.isidentifier() for name in names):
        return "it is not named module:qualname"
    try:
        found: object = importlib.import_module(module)
        for part in parts:
            found = getattr(found, part)
    except ImportError as exc:
        return f"its module cannot be imported here ({exc})"
    except AttributeError:
        return f"module {module} has no {qualname} here"
    except Exception as exc:  # the module's own code raised while being imported
        return f"importing its module raised {type(exc).__name__}: {exc}"
    if not isinstance(found, type):
        return f"{module}.{qualname} is not a class here"
    return found


def _tuple_class(type_name: str, fields: tuple[str, ...]) -> _Found:
    found = _find_class(type_name)
    if isinstance(found, str):
        return found
    if not issubclass(found, tuple) or getattr(found, "_fields", None) != fields:
        return f"the class here is not a namedtuple with the server's fields {fields}"
    return found


def _mapping_rebuild(type_name: str) -> _Rebuild | str:
    """How to rebuild a Mapping node of this type from its items (NOTE [ Batch types ])."""
    found = _find_class(type_name)
    if isinstance(found, str):
        return found
    if issubclass(found, MutableMapping):
        return functools.partial(_filled, found)
    if issubclass(found, Mapping):
        return found
    if dataclasses.is_dataclass(found):
        return functools.partial(_from_fields, found)
    return "the class here is neither a dataclass nor a Mapping"


def _filled(cls: type[MutableMapping[Any, Any]], items: dict[Any, Any]) -> Any:
    mapping = cls()
    mapping.update(items)
    return mapping


def _from_fields(cls: type, items: dict[Any, Any]) -> Any:
    return cls(**items)


def _stand_in(type_name: str, fields: tuple[str, ...]) -> type[Any]:
    """A namedtuple made here for a class the client does not have."""
    name = type_name.rpartition(".")[2].rpartition(":")[2]
    if not name.isidentifier() or keyword.iskeyword(name):
        name = "Batch"
    return collections.namedtuple(name, fields, rename=True)


class BatchTypes:
    """The classes headers name, each looked up once, and the types warned about; a namedtuple or
    Mapping node rebuilt as its class, or as a stand-in with a warning (NOTE [ Batch types ])."""

    def __init__(self) -> None:
        cache = functools.lru_cache(maxsize=CACHED_TYPES)
        self.tuple_class = cache(_tuple_class)
        self.mapping_rebuild = cache(_mapping_rebuild)
        self.stand_in = cache(_stand_in)
        self.warned: set[str] = set()

    def warn(self, type_name: str, why: str, instead: str) -> None:
        if type_name in self.warned or len(self.warned) >= CACHED_TYPES:
            return
        self.warned.add(type_name)
        warnings.warn(
            f"the server's batches hold a {type_name!r}, which cannot be rebuilt here: {why}. "
            f"They arrive as {instead} instead. To get the class itself, make the module "
            "that defines it importable on the trainer, with the same class at its top level "
            "(NOTE [ Batch types ] in remote_loader.protos.batch_types).",
            UserWarning,
            stacklevel=2,
        )

    def namedtuple(
        self, type_name: str, fields: tuple[str, ...], items: list[Any]
    ) -> tuple[Any, ...]:
        """A namedtuple node of type `type_name` from its decoded `items`, one per field."""
        found = self.tuple_class(type_name, fields)
        if isinstance(found, str):
            why = found
        else:
            try:
                rebuilt: tuple[Any, ...] = found(*items)
                return rebuilt
            except Exception as exc:
                why = f"{found.__qualname__}(*fields) raised {type(exc).__name__}: {exc}"
        stand_in = self.stand_in(type_name, fields)
        made_here = f"a namedtuple {stand_in.__name__}({', '.join(stand_in._fields)}) made here"
        self.warn(type_name, why, made_here)
        made: tuple[Any, ...] = stand_in(*items)
        return made

    def mapping(self, type_name: str, items: dict[Any, Any]) -> Any:
        """A Mapping node of type `type_name` from its decoded `items`."""
        rebuild = self.mapping_rebuild(type_name)
        if isinstance(rebuild, str):
            why = rebuild
        else:
            try:
                return rebuild(items)
            except Exception as exc:
                why = f"rebuilding it from its items raised {type(exc).__name__}: {exc}"
        self.warn(type_name, why, "a dict")
        return items


# The one a decoder reads; a test puts a fresh one in its place.
TYPES = BatchTypes()
