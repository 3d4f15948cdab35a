"""The file names a torch.distributed.checkpoint ``.metadata`` names, read without torch.

``.metadata`` is a pickle of DCP's ``Metadata``; its ``storage_data`` maps each chunk to a
``_StorageInfo`` whose ``relative_path`` is the file holding it (``__0_0.distcp``, ...).
Unpickling a file from a shared bucket with the real classes would let whoever wrote it run
code as us (root, on a training node), and would need torch. So every class the pickle names
becomes an inert stand-in that only records what it was built with; nothing it names is ever
imported or called. The stand-ins are then searched for ``relative_path`` strings.
"""

from __future__ import annotations

import io
import pickle

MAX_DEPTH = 64  # deeper nesting than any DCP metadata has: not walked further


class MetadataError(ValueError):
    """The bytes are not a DCP .metadata we can read."""


class _Inert:
    """What any global in the pickle becomes: keeps its arguments, state and items. (Built by
    ``__new__`` alone for most objects: the defaults live on the class.)"""

    _args: tuple = ()
    _kwargs: dict = {}
    _state: object = None

    def __init__(self, *args, **kwargs):
        self._args, self._kwargs = args, kwargs

    def __setstate__(self, state):
        self._state = state

    def _list(self) -> list:
        return self.__dict__.setdefault("_items", [])

    def __setitem__(self, key, value):
        self._list().append((key, value))

    def append(self, value):
        self._list().append(value)

    def extend(self, values):
        self._list().extend(values)


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes):
        super().__init__(io.BytesIO(data))
        self._classes: dict[tuple[str, str], type] = {}

    def find_class(self, module: str, name: str) -> type:
        key = (module, name)
        if key not in self._classes:  # one stand-in class per name, never the real one
            self._classes[key] = type(
                name if name.isidentifier() else "_", (_Inert,), {"_origin": f"{module}.{name}"}
            )
        return self._classes[key]

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("persistent ids (tensor storages) are not expected in DCP metadata")


def referenced_files(data: bytes) -> set[str]:
    """The relative paths of the files the metadata's storage entries name. MetadataError if the
    bytes are not a readable pickle or name no file at all."""
    try:
        root = _Unpickler(data).load()
    except Exception as e:  # noqa: BLE001 - a corrupt pickle can raise almost anything
        raise MetadataError(f"not a readable DCP .metadata ({type(e).__name__})") from None
    names: set[str] = set()
    _collect(root, names, set(), 0)
    if not names:
        raise MetadataError("the DCP .metadata names no files")
    return names


def _collect(value: object, names: set[str], seen: set[int], depth: int) -> None:
    if depth > MAX_DEPTH or not isinstance(value, (_Inert, dict, list, tuple, set, frozenset)):
        return
    if id(value) in seen:  # a pickle shares objects through its memo: each is walked once
        return  # (or a hostile one makes the walk exponential); all stay alive meanwhile
    seen.add(id(value))
    if isinstance(value, _Inert):
        state = value._state  # (walked as it came: a merged copy would be a new object each time)
        fields = state
        if (
            isinstance(state, tuple)
            and len(state) == 2
            and all(isinstance(s, dict) or s is None for s in state)
        ):  # (dict, slots) of a slotted class
            fields = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(fields, dict) and isinstance(fields.get("relative_path"), str):
            names.add(fields["relative_path"])
        for part in (value._args, value._kwargs, state, value.__dict__.get("_items", ())):
            _collect(part, names, seen, depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            _collect(key, names, seen, depth + 1)
            _collect(item, names, seen, depth + 1)
    else:
        for item in value:
            _collect(item, names, seen, depth + 1)
