"""Every field of a config, as `spotrl <command> --help` lists it: read from the pydantic schema, so it cannot drift.

A section (a pydantic model, or one that may be null) is listed by its dotted name and then its own fields, each under
the dotted key that `--set KEY=VALUE` takes (`grpo.max_steps`); any other field (a list, a mapping, a scalar) is one
key, with its type, its default and the one-line description its schema gives it.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo


@dataclass(frozen=True)
class ConfigKey:
    """One line of the listing: a section (`is_section`) or a field that `--set key=value` sets."""

    key: str
    type_text: str
    default_text: str
    description: str
    is_section: bool = False


def section_of(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds when the field is a section (`LoraConfig`, or `OpenEnvConfig | None`); else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (Union, types.UnionType):
        models = [a for a in get_args(annotation) if a is not type(None)]
        if len(models) == 1:
            return section_of(models[0])
    return None


def type_text(annotation: Any) -> str:
    """A short, readable type: `int`, `str | null`, `constant|linear|cosine`, `dict[str, float]`."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return type_text(args[0])
    if origin is Literal:
        return "|".join(str(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(type_text(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', origin)}[{', '.join(type_text(a) for a in args)}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def default_text(field: FieldInfo) -> str:
    """The default as YAML would spell it, `required` where there is none."""
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, BaseModel) or (isinstance(value, list) and any(isinstance(v, BaseModel) for v in value)):
        items = value if isinstance(value, list) else [value]
        names = ", ".join(getattr(v, "kind", type(v).__name__) for v in items)
        return f"[{names}]" if isinstance(value, list) else names
    if isinstance(value, str):
        return repr(value)
    return str(value)


def item_models(annotation: Any) -> list[type[BaseModel]]:
    """The models a list or a mapping of sections holds (`objectives`: each kind's), set whole as YAML."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return item_models(args[0])
    if origin in (list, dict):
        item = args[-1]
        while get_origin(item) is Annotated:
            item = get_args(item)[0]
        members = get_args(item) if get_origin(item) in (Union, types.UnionType) else (item,)
        return [m for m in members if isinstance(m, type) and issubclass(m, BaseModel)]
    return []


def kind_models(annotation: Any) -> list[type[BaseModel]]:
    """The models a field may hold, one of several kinds (a judge's `verdict`: generative or logprob)."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) not in (Union, types.UnionType):
        return []
    return [m for m in get_args(annotation) if isinstance(m, type) and issubclass(m, BaseModel)]


def config_keys(schema: type[BaseModel], prefix: str = "") -> list[ConfigKey]:
    """Every field of `schema` with its dotted key, a section's own fields before its subsections (each a heading,
    then its fields); the models a list or mapping holds are listed after it, under `key[]`."""
    leaves, nested = [], []
    for name, field in schema.model_fields.items():
        key = f"{prefix}{name}"
        description = field.description or ""
        section = section_of(field.annotation)
        if section is not None:
            optional = "optional section, null unless set" if not field.is_required() and field.default is None else ""
            nested.append(ConfigKey(key, section.__name__, optional, description, is_section=True))
            nested.extend(config_keys(section, f"{key}."))
            continue
        leaves.append(ConfigKey(key, type_text(field.annotation), default_text(field), description))
        for model in kind_models(field.annotation):
            heading = f"one kind of {key}: {(model.__doc__ or '').strip().splitlines()[0]}"
            nested.append(ConfigKey(key, model.__name__, "", heading, is_section=True))
            nested.extend(config_keys(model, f"{key}."))
        for model in item_models(field.annotation):
            heading = f"an item of {key}, set whole as YAML: {(model.__doc__ or '').strip().splitlines()[0]}"
            nested.append(ConfigKey(f"{key}[]", model.__name__, "", heading, is_section=True))
            nested.extend(config_keys(model, f"{key}[]."))
    return leaves + nested


def fields_help(schema: type[BaseModel]) -> str:
    """The listing that ends `spotrl <command> --help`: one line per key, sections as headings."""
    lines = [f"{schema.__name__} fields (set any with --set KEY=VALUE, the value read as YAML):"]
    for k in config_keys(schema):
        if k.is_section:
            note = f" ({k.default_text})" if k.default_text else ""
            lines.append(f"\n  {k.key} ({k.type_text}): {k.description}{note}")
        else:
            lines.append(f"    {k.key} ({k.type_text}, default {k.default_text}): {k.description}")
    return "\n".join(lines)
