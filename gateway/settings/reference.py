"""The config reference (docs/config-reference.md), generated from the config models themselves so it cannot drift:
`gateway config reference` writes it, `--check` fails when the checked-in file is stale (tests run it).

One section per model, in the order a config file nests them: each field with its type, default, bounds and
description. A union of models (pool kinds, pricing types, routing policies) gets one section per member, named by
its tag (`pools[] (kind: sglang)`)."""

from __future__ import annotations

import argparse
import inspect
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

DEFAULT_OUT = "docs/config-reference.md"
HEADER = """# Config reference

Every field of the gateway config (`gateway serve --config FILE`), generated from the models that validate it
(`gateway/config.py` and `gateway/settings/`) by `gateway config reference`; a test fails when this file is stale.
Unknown fields are errors, and every error names the field's path as the headings below spell it. How the parts
work: [gateway.md](gateway.md), [routing.md](routing.md), [tenancy.md](tenancy.md), [deploy.md](deploy.md).
"""


def _models(ann: Any) -> list[type[BaseModel]]:
    """The models an annotation holds (through unions, lists, dicts, Annotated), in order."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [ann]
    return [m for a in get_args(ann) for m in _models(a)]


def _container(ann: Any) -> str:
    """'[]' for a list of models, '.<name>' for a dict of them, '' otherwise."""
    origin = get_origin(ann)
    if origin is Annotated or origin in (Union, types.UnionType):
        return next((c for a in get_args(ann) if (c := _container(a))), "")
    if origin is list:
        return "[]"
    if origin is dict:
        return ".<name>"
    return ""


def _type(ann: Any) -> str:
    origin, args = get_origin(ann), get_args(ann)
    if origin is Annotated:
        return _type(args[0])
    if origin in (Union, types.UnionType):
        return " | ".join(dict.fromkeys(_type(a) for a in args))
    if origin is Literal:
        return " | ".join(f"`{a}`" for a in args)
    if origin is list:
        return f"list of {_type(args[0])}"
    if origin is dict:
        return f"map of {_type(args[0])} to {_type(args[1])}"
    if ann is type(None):
        return "null"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "section"
    return getattr(ann, "__name__", str(ann))


def _default(f: FieldInfo) -> str:
    if f.default_factory is not None:
        value = f.default_factory()  # type: ignore[call-arg]
    elif f.default is PydanticUndefined:
        return "required"
    else:
        value = f.default
    if isinstance(value, BaseModel):
        return "(section)"
    if value is None:
        return "unset"
    return f"`{value}`" if not isinstance(value, (list, dict)) or value else "`[]`" if isinstance(value, list) else "`{}`"


_BOUNDS = ((at.Ge, "≥", "ge"), (at.Gt, ">", "gt"), (at.Le, "≤", "le"), (at.Lt, "<", "lt"),
           (at.MinLen, "length ≥", "min_length"), (at.MaxLen, "length ≤", "max_length"))


def _bounds(f: FieldInfo) -> str:
    out = []
    for m in f.metadata:
        for kind, sign, attr in _BOUNDS:
            if isinstance(m, kind):
                out.append(f"{sign} {getattr(m, attr)}")
        if getattr(m, "pattern", None):
            out.append(f"matches `{m.pattern}`")
    return ", ".join(out)


def _tag(model: type[BaseModel]) -> str:
    """A union member's tag: its one-value Literal discriminator field (`kind: sglang`), if any."""
    for name in ("kind", "type"):
        f = model.model_fields.get(name)
        if f is not None and get_origin(f.annotation) is Literal and len(get_args(f.annotation)) == 1:
            return f"{name}: {get_args(f.annotation)[0]}"
    return ""


def _sections(model: type[BaseModel], path: str, title: str) -> Iterator[tuple[str, type[BaseModel]]]:
    yield title, model
    for name, f in model.model_fields.items():
        members = _models(f.annotation)
        sub = f"{path}.{name}" if path else name
        sub += _container(f.annotation)
        for m in members:
            tag = _tag(m) if len(members) > 1 else ""
            yield from _sections(m, sub, f"{sub} ({tag})" if tag else sub)


def _doc(model: type[BaseModel]) -> str:
    doc = inspect.getdoc(model) or ""
    if not doc or model.__doc__ is None or "__doc__" not in model.__dict__:
        return ""
    return " ".join(doc.split("\n\n")[0].split())


def _cell(text: str) -> str:
    return " ".join(text.replace("|", "\\|").split())


def render() -> str:
    from gateway.config import GatewayConfig

    out = [HEADER]
    seen: set[str] = set()
    for title, model in _sections(GatewayConfig, "", "(top level)"):
        if title in seen:
            continue
        seen.add(title)
        out.append(f"## `{title}`\n" if title != "(top level)" else "## Top level\n")
        if doc := _doc(model):
            out.append(doc + "\n")
        out.append("| field | type | default | bounds | description |")
        out.append("|---|---|---|---|---|")
        for name, f in model.model_fields.items():
            kind = _type(f.annotation)
            if _models(f.annotation):  # the section(s) below, by the path a config file spells
                path = title.split(" (")[0] if title != "(top level)" else ""
                kind = kind.replace("section", f"section `{path + '.' if path else ''}{name}"
                                    f"{_container(f.annotation)}`")
            out.append(f"| `{name}` | {_cell(kind)} | {_cell(_default(f))} | {_cell(_bounds(f))} | "
                       f"{_cell(f.description or '')} |")
        out.append("")
    return "\n".join(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="config_cmd", required=True)
    sp = sub.add_parser("reference", help=f"write the config reference (default {DEFAULT_OUT})")
    sp.add_argument("--out", default=DEFAULT_OUT)
    sp.add_argument("--check", action="store_true", help="exit 1 if the file differs from what would be written")


def run(a: argparse.Namespace) -> int:
    text, path = render(), Path(a.out)
    if a.check:
        if not path.is_file() or path.read_text() != text:
            print(f"{path} is stale: run `gateway config reference --out {path}`", file=sys.stderr)
            return 1
        print(f"{path} is up to date")
        return 0
    path.write_text(text)
    print(f"wrote {path}")
    return 0
