"""The base of every wire message: a frozen dataclass that encodes itself and checks what it decodes.

A message type is declared once, with its fields' types and bounds:

    @dataclass(frozen=True)
    class Progress(Message):
        step: int = bounded(minimum=0)
        devices: int = bounded(minimum=1, maximum=4096)
        engine: str | None = None

`Progress.from_dict(obj)` returns a Progress or raises `ProtocolError("step", "...")` for the
first field that is missing, of the wrong type or out of bounds. Supported field types: int,
float, str, bool, `X | None`, `tuple[X, ...]`, `dict[str, X]`, `Literal[...]`, an `Enum` (a
`StrEnum` of protocol.states: decoded to its member, encoded as its value), another Message,
and `Any` (passed through untouched: for payloads another layer validates). Unknown keys are
ignored, so an older receiver accepts a newer sender's additions; a message whose "v" is newer
than its type's `VERSION` (`PROTOCOL_VERSION` unless the type raised its own) is refused by name. A
type raises its own VERSION when an addition must not be ignored by an older reader: that reader
then refuses the message instead of acting on the part it knows (protocol.launch.SandboxSpec).
`json_schema()` publishes the shape (the agent API's generated OpenAPI schema uses it).
"""
from __future__ import annotations

import dataclasses
import enum
import math
import re
import types
import typing
from typing import Any, ClassVar, Literal, TypeVar, get_args, get_origin, get_type_hints

PROTOCOL_VERSION = 1
VERSION_KEY = "v"

M = TypeVar("M", bound="Message")


class ProtocolError(ValueError):
    """A received message does not have its type's shape. `field` is a dotted path ("jobs.2.step")."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}" if field else problem)
        self.field = field
        self.problem = problem


def bounded(*, default: Any = dataclasses.MISSING, minimum: float | None = None,
            maximum: float | None = None, max_length: int | None = None, pattern: str | None = None) -> Any:
    """Returns a dataclass field whose value (a number, or a str/tuple/dict's length) is bounded;
    `pattern`: a str value must match this regular expression in full (re.fullmatch)."""
    metadata = {"minimum": minimum, "maximum": maximum, "max_length": max_length, "pattern": pattern}
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple or None as a message field's default")
    return dataclasses.field(default=default, metadata=metadata)


class Message:
    """Base class of the wire messages; subclasses are `@dataclass(frozen=True)`."""

    _hints: ClassVar[dict[type, dict[str, Any]]] = {}
    # The newest version of this type's wire dict this side writes and reads (see the module docstring).
    VERSION: ClassVar[int] = PROTOCOL_VERSION

    def to_dict(self) -> dict[str, Any]:
        """Returns the JSON-ready dict for the wire, with the protocol version under "v"."""
        return {VERSION_KEY: self.VERSION, **_encode_fields(self)}

    @classmethod
    def from_dict(cls: type[M], obj: Any, *, path: str = "") -> M:
        """Returns the message `obj` encodes; raises ProtocolError naming the first bad field."""
        if not isinstance(obj, dict):
            raise ProtocolError(path, f"must be a JSON object ({cls.__name__}), not {_kind(obj)}")
        version = obj.get(VERSION_KEY, PROTOCOL_VERSION)
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ProtocolError(_join(path, VERSION_KEY), "must be a positive integer protocol version")
        if version > cls.VERSION:
            raise ProtocolError(_join(path, VERSION_KEY),
                                f"protocol version {version} of {cls.__name__} is newer than this side's "
                                f"{cls.VERSION}; "
                                "upgrade this side first")
        values = {}
        for field, hint, optional in _plan(cls):
            name = _join(path, field.name)
            if field.name not in obj or (obj[field.name] is None and optional):
                if field.default is not dataclasses.MISSING:
                    values[field.name] = field.default
                    continue
                if field.default_factory is not dataclasses.MISSING:
                    values[field.name] = field.default_factory()
                    continue
                if field.name not in obj:
                    raise ProtocolError(name, "is required")
            value = _decode(hint, obj[field.name], name)
            _check_bounds(field, value, name)
            values[field.name] = value
        return cls(**values)

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        """Returns the JSON Schema (OpenAPI 3.0 dialect: "nullable") of this message's wire dict,
        with its bounds: what the HTTP edge publishes in the generated OpenAPI schema."""
        return _message_schema(cls, top=True)


def _message_schema(cls: type[Message], *, top: bool = False) -> dict[str, Any]:
    properties: dict[str, Any] = {}
    if top:
        properties[VERSION_KEY] = {"type": "integer", "minimum": 1, "maximum": cls.VERSION,
                                   "description": "protocol version (absent: 1)"}
    required = []
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        schema = _schema(_hints(cls)[field.name])
        metadata = field.metadata
        if metadata.get("minimum") is not None:
            schema["minimum"] = metadata["minimum"]
        if metadata.get("maximum") is not None:
            schema["maximum"] = metadata["maximum"]
        if metadata.get("max_length") is not None:
            length_key = {"array": "maxItems", "object": "maxProperties"}.get(str(schema.get("type")), "maxLength")
            schema[length_key] = metadata["max_length"]
        if metadata.get("pattern") is not None:
            schema["pattern"] = f"^{metadata['pattern']}$"
        properties[field.name] = schema
        if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            required.append(field.name)
    schema = {"type": "object", "title": cls.__name__, "properties": properties}
    if cls.__doc__:
        schema["description"] = " ".join(cls.__doc__.split())
    if required:
        schema["required"] = required
    return schema


def _schema(hint: Any) -> dict[str, Any]:
    if hint is Any:
        return {}
    if _is_union(hint):
        options = [option for option in get_args(hint) if option is not type(None)]
        schema: dict[str, Any] = (_schema(options[0]) if len(options) == 1
                                  else {"oneOf": [_schema(o) for o in options]})
        if type(None) in get_args(hint):
            schema["nullable"] = True
        return schema
    origin = get_origin(hint)
    if origin is Literal:
        return {"enum": list(get_args(hint))}
    if origin is tuple:
        args = get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": _schema(args[0])}
        return {"type": "array", "minItems": len(args), "maxItems": len(args)}
    if origin is dict:
        return {"type": "object", "additionalProperties": _schema(get_args(hint)[1])}
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return {"type": "string", "enum": [member.value for member in hint]}
    if isinstance(hint, type) and issubclass(hint, Message):
        return _message_schema(hint)
    return {"type": {bool: "boolean", int: "integer", float: "number", str: "string"}[hint]}


def _hints(cls: type) -> dict[str, Any]:
    hints = Message._hints.get(cls)
    if hints is None:
        hints = Message._hints[cls] = get_type_hints(cls)
    return hints


def _encode_fields(message: Message) -> dict[str, Any]:
    return {field.name: _encode(getattr(message, field.name))
            for field in dataclasses.fields(message)}  # type: ignore[arg-type]


def _encode(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Message):
        return _encode_fields(value)
    if isinstance(value, tuple):
        return [_encode(item) for item in value]
    if isinstance(value, dict):
        return {key: _encode(item) for key, item in value.items()}
    return value


def _optional(hint: Any) -> bool:
    return _is_union(hint) and type(None) in get_args(hint)


def _is_union(hint: Any) -> bool:
    return get_origin(hint) in (typing.Union, types.UnionType)


_plans: dict[type, tuple] = {}


def _plan(cls: type) -> tuple:
    """Returns ((field, its type hint, whether it may be null), ...) of message type `cls`, worked
    out once per type: decoding asked typing for the same answers for every field of every message."""
    plan = _plans.get(cls)
    if plan is None:
        hints = _hints(cls)
        plan = _plans[cls] = tuple((field, hints[field.name], _optional(hints[field.name]))
                                   for field in dataclasses.fields(cls))
    return plan


_shapes: dict[Any, tuple] = {}


def _shape(hint: Any) -> tuple:
    """Returns what _decode needs to know of a type hint, worked out once per hint: (kind, ...)."""
    shape = _shapes.get(hint)
    if shape is not None:
        return shape
    if hint is Any:
        shape = ("any",)
    elif _is_union(hint):
        shape = ("union", tuple(option for option in get_args(hint) if option is not type(None)),
                 type(None) in get_args(hint))
    elif get_origin(hint) is Literal:
        shape = ("literal", get_args(hint))
    elif get_origin(hint) is tuple:
        args = get_args(hint)
        shape = ("items", args[0]) if len(args) == 2 and args[1] is Ellipsis else ("fixed", args)
    elif get_origin(hint) is dict:
        shape = ("dict", *get_args(hint))
    elif isinstance(hint, type) and issubclass(hint, enum.Enum):
        shape = ("enum", hint, tuple(member.value for member in hint))
    elif isinstance(hint, type) and issubclass(hint, Message):
        shape = ("message", hint)
    elif hint in (bool, int, float, str):
        shape = (hint.__name__,)
    else:
        shape = ("unsupported",)
    _shapes[hint] = shape
    return shape


def _decode(hint: Any, value: Any, path: str) -> Any:
    shape = _shape(hint)
    kind = shape[0]
    if kind == "any":
        return value
    if kind == "union":
        options, nullable = shape[1], shape[2]
        if value is None:
            if nullable:
                return None
            raise ProtocolError(path, "must not be null")
        if len(options) == 1:
            return _decode(options[0], value, path)
        errors = []
        for option in options:
            try:
                return _decode(option, value, path)
            except ProtocolError as exc:
                errors.append(exc.problem)
        raise ProtocolError(path, " or ".join(errors))
    if kind == "literal":
        if value not in shape[1] or isinstance(value, bool):
            raise ProtocolError(path, f"must be one of {', '.join(map(repr, shape[1]))}, not {value!r}")
        return value
    if kind == "items":
        if not isinstance(value, (list, tuple)):
            raise ProtocolError(path, f"must be a list, not {_kind(value)}")
        return tuple(_decode(shape[1], item, f"{path}.{i}") for i, item in enumerate(value))
    if kind == "fixed":
        if not isinstance(value, (list, tuple)):
            raise ProtocolError(path, f"must be a list, not {_kind(value)}")
        args = shape[1]
        if len(value) != len(args):
            raise ProtocolError(path, f"must be a list of {len(args)} items, not {len(value)}")
        return tuple(_decode(arg, item, f"{path}.{i}") for i, (arg, item) in enumerate(zip(args, value)))
    if kind == "dict":
        if not isinstance(value, dict):
            raise ProtocolError(path, f"must be a JSON object, not {_kind(value)}")
        key_hint, value_hint = shape[1], shape[2]
        return {_decode(key_hint, key, f"{path}.{key}"): _decode(value_hint, item, f"{path}.{key}")
                for key, item in value.items()}
    if kind == "enum":
        values = shape[2]
        if isinstance(value, bool) or not isinstance(value, (str, int)) or value not in values:
            raise ProtocolError(path, f"must be one of {', '.join(map(repr, values))}, not {value!r}")
        return shape[1](value)
    if kind == "message":
        return shape[1].from_dict(value, path=path)
    if kind == "bool":
        if not isinstance(value, bool):
            raise ProtocolError(path, f"must be true or false, not {_kind(value)}")
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(path, f"must be an integer, not {_kind(value)}")
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(path, f"must be a number, not {_kind(value)}")
        if not math.isfinite(value):
            raise ProtocolError(path, "must be a finite number")
        return float(value)
    if kind == "str":
        if not isinstance(value, str):
            raise ProtocolError(path, f"must be a string, not {_kind(value)}")
        return value
    raise TypeError(f"{path}: a message field of type {hint!r} is not supported")


def _check_bounds(field: dataclasses.Field, value: Any, path: str) -> None:
    if value is None:
        return
    minimum, maximum = field.metadata.get("minimum"), field.metadata.get("maximum")
    if minimum is not None and value < minimum:
        raise ProtocolError(path, f"must be at least {minimum}, not {value}")
    if maximum is not None and value > maximum:
        raise ProtocolError(path, f"must be at most {maximum}, not {value}")
    max_length = field.metadata.get("max_length")
    if max_length is not None and len(value) > max_length:
        raise ProtocolError(path, f"must have at most {max_length} items or characters, not {len(value)}")
    pattern = field.metadata.get("pattern")
    if pattern is not None and isinstance(value, str) and re.fullmatch(pattern, value) is None:
        raise ProtocolError(path, f"must match {pattern}")


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)
