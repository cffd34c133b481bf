"""Deterministic JSON that conforms to a JSON schema: the simulator's stand-in for constrained decoding.

SGLang answers `response_format: json_schema` and tool calls through a grammar (xgrammar), so the text always parses
and validates. Here a small generator walks the schema with a seeded RNG instead: the same (schema, seed) gives the
same value in every process.

Supported: `type` (one or a list), `enum`, `const`, `object` (`properties`, `required`, `additionalProperties: false`,
`minProperties`), `array` (`items`, `prefixItems`, `minItems`, `maxItems`, `uniqueItems`), `string` (`minLength`,
`maxLength`, a few `format`s), `integer`/`number` (`minimum`, `maximum`, exclusive bounds, `multipleOf`), `boolean`,
`null`, `anyOf`/`oneOf` (one branch), `allOf` (merged), `$ref` to `#`, `#/$defs/..` or `#/definitions/..` (what
pydantic emits). Not supported: `pattern` (ignored), `not`, `if/then/else`, remote refs.
Recursive schemas stay finite: past a depth only required properties and minimum-length arrays are produced, and a
schema that still recurses past the hard limit is refused as unsatisfiable here (SchemaError -> 400).
"""

from __future__ import annotations

import random
import uuid
from typing import Any

SOFT_DEPTH = 6  # past this, optional properties and extra array items are left out
HARD_DEPTH = 40  # past this, the schema is refused (a required self-reference never ends)
MAX_VALUES = 10_000  # bound the work per request: a schema demanding more (minItems: 1e9) is refused
MAX_STRING = 100_000

_WORDS = ("cache", "route", "token", "prefix", "replica", "batch", "queue", "node", "model", "fast", "load", "time")
_TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")


class SchemaError(ValueError):
    """The schema is malformed or cannot be satisfied by this generator."""


class Budget:
    """What one request may still generate, in values (a string costs one per 16 characters): shared by every
    schema of a request (its tools, its choices), so no request can buy unbounded work with many small schemas."""

    def __init__(self, values: int = MAX_VALUES) -> None:
        self.total = values
        self.left = values

    def spend(self, n: int = 1) -> None:
        self.left -= n
        if self.left < 0:
            raise SchemaError(f"the request's schemas demand more than {self.total} values")


def generate(schema: Any, rng: random.Random, budget: Budget | None = None) -> Any:
    """A value conforming to `schema`, drawn deterministically from `rng`."""
    return _Gen(schema, rng, budget or Budget()).value(schema, 0)


def check_schema(schema: Any, budget: Budget | None = None) -> None:
    """Refuse what is not a schema at all (SGLang checks tool parameters with a JSON-Schema meta-validator)."""
    if not isinstance(schema, (dict, bool)):
        raise SchemaError(f"{schema!r} is not of type 'object', 'boolean'")
    generate(schema, random.Random(0), budget)


class _Gen:
    def __init__(self, root: Any, rng: random.Random, budget: Budget) -> None:
        self.root = root
        self.rng = rng
        self.budget = budget

    def value(self, s: Any, depth: int) -> Any:
        if depth > HARD_DEPTH:
            raise SchemaError("schema is too deeply nested or recursive")
        self.budget.spend()
        if s is True or s == {}:
            return self.rng.choice(_WORDS)
        if s is False:
            raise SchemaError("schema 'false' admits no value")
        if not isinstance(s, dict):
            raise SchemaError(f"{s!r} is not of type 'object', 'boolean'")
        if "$ref" in s:
            return self.value(self._resolve(s["$ref"]), depth + 1)
        if "const" in s:
            return s["const"]
        if "enum" in s:
            enum = s["enum"]
            if not isinstance(enum, list) or not enum:
                raise SchemaError("'enum' must be a non-empty array")
            return enum[self.rng.randrange(len(enum))]
        for key in ("anyOf", "oneOf"):
            if key in s:
                branches = s[key]
                if not isinstance(branches, list) or not branches:
                    raise SchemaError(f"'{key}' must be a non-empty array")
                # prefer a non-null branch so Optional[...] fields carry a value
                real = [b for b in branches if not (isinstance(b, dict) and b.get("type") == "null")] or branches
                return self.value(real[self.rng.randrange(len(real))], depth + 1)
        if "allOf" in s:
            parts = s["allOf"]
            if not isinstance(parts, list):
                raise SchemaError("'allOf' must be an array")
            merged = {k: v for k, v in s.items() if k != "allOf"}
            for p in parts:
                p = self._resolve(p["$ref"]) if isinstance(p, dict) and "$ref" in p else p
                if p is False:
                    raise SchemaError("'allOf' with a false schema admits no value")
                if isinstance(p, dict):
                    merged = _merge(merged, p)
            return self.value(merged, depth + 1)
        t = s.get("type")
        if isinstance(t, list):
            if not t or not all(isinstance(x, str) for x in t):
                raise SchemaError("'type' must be a string or a non-empty array of strings")
            real = [x for x in t if x != "null"] or t
            t = real[self.rng.randrange(len(real))]
        if t is None:
            t = "object" if "properties" in s else "array" if "items" in s else "string"
        if t not in _TYPES:
            raise SchemaError(f"{t!r} is not valid under any of the given schemas")
        return getattr(self, "_" + t)(s, depth)

    def _resolve(self, ref: Any) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise SchemaError(f"unsupported $ref {ref!r} (only local references)")
        node = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                raise SchemaError(f"unresolvable $ref {ref!r}")
            node = node[part]
        return node

    def _object(self, s: dict[str, Any], depth: int) -> dict[str, Any]:
        props = s.get("properties", {})
        required = s.get("required", [])
        if not isinstance(props, dict) or not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError("'properties' must be an object and 'required' an array of strings")
        out: dict[str, Any] = {}
        for name, sub in props.items():
            if name in required or (depth < SOFT_DEPTH and self.rng.random() < 0.7):
                out[name] = self.value(sub, depth + 1)
        extra = s.get("additionalProperties", True)
        for name in required:  # required but not described: any value the additional schema allows
            if name not in out:
                out[name] = self.value(extra if isinstance(extra, dict) else {}, depth + 1)
        want = _int(s.get("minProperties", 0))
        i = 0
        while len(out) < want and extra is not False and i < 64:
            out.setdefault(f"{self.rng.choice(_WORDS)}_{i}", self.value(extra if isinstance(extra, dict) else {}, depth + 1))
            i += 1
        return out

    def _array(self, s: dict[str, Any], depth: int) -> list[Any]:
        lo = _int(s.get("minItems", 0))
        hi = _int(s.get("maxItems", max(lo, 3)))
        if hi < lo:
            raise SchemaError("maxItems is less than minItems")
        n = lo if depth >= SOFT_DEPTH else self.rng.randint(lo, min(hi, max(lo, 3)))
        prefix = s.get("prefixItems", [])
        if not isinstance(prefix, list):
            raise SchemaError("'prefixItems' must be an array")
        items = s.get("items", {})
        out: list[Any] = []
        tries = 0
        while len(out) < n and tries < 4 * n + 8:
            tries += 1
            sub = prefix[len(out)] if len(out) < len(prefix) else items
            if sub is False:
                break
            v = self.value(sub, depth + 1)
            if s.get("uniqueItems") and v in out:
                continue
            out.append(v)
        return out

    def _string(self, s: dict[str, Any], depth: int) -> str:
        fmt = s.get("format")
        if fmt == "date-time":
            return f"2026-01-{self.rng.randint(1, 28):02d}T{self.rng.randint(0, 23):02d}:00:00Z"
        if fmt == "date":
            return f"2026-01-{self.rng.randint(1, 28):02d}"
        if fmt == "email":
            return f"{self.rng.choice(_WORDS)}@example.com"
        if fmt in ("uri", "url"):
            return f"https://example.com/{self.rng.choice(_WORDS)}"
        if fmt == "uuid":
            return str(uuid.UUID(int=self.rng.getrandbits(128), version=4))
        lo = _int(s.get("minLength", 0))
        hi = _int(s.get("maxLength", max(lo, 24)))
        if hi < lo:
            raise SchemaError("maxLength is less than minLength")
        if lo > MAX_STRING:
            raise SchemaError(f"minLength above {MAX_STRING} characters")
        self.budget.spend(lo // 16)
        words = " ".join(self.rng.choice(_WORDS) for _ in range(self.rng.randint(1, 3)))
        while len(words) < lo:
            words += " " + self.rng.choice(_WORDS)
        return words[:hi]

    def _integer(self, s: dict[str, Any], depth: int) -> int:
        lo, hi = _bounds(s, integer=True)
        step = s.get("multipleOf")
        if isinstance(step, int) and not isinstance(step, bool) and step > 0:
            first = -(-lo // step) * step
            if first > hi:
                raise SchemaError("no multiple of multipleOf within the bounds")
            return int(first + step * self.rng.randint(0, min((hi - first) // step, 100)))
        return int(self.rng.randint(lo, hi))

    def _number(self, s: dict[str, Any], depth: int) -> float | int:
        if isinstance(s.get("multipleOf"), int):
            return int(self._integer(s, depth))
        lo, hi = _bounds(s, integer=False)
        r = self.rng.random()
        v = round(lo * (1 - r) + hi * r, 3)  # no hi - lo: it overflows to inf for bounds near ±1e308
        return float(v if lo <= v <= hi else lo)

    def _boolean(self, s: dict[str, Any], depth: int) -> bool:
        return self.rng.random() < 0.5

    def _null(self, s: dict[str, Any], depth: int) -> None:
        return None


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise SchemaError(f"{v!r} is not a non-negative integer")
    return v


def _bounds(s: dict[str, Any], integer: bool) -> tuple[Any, Any]:
    """[lo, hi] from minimum/maximum and the exclusive forms; a default window of 0..100 when open."""
    lo: Any = s.get("minimum")
    hi: Any = s.get("maximum")
    xlo, xhi = s.get("exclusiveMinimum"), s.get("exclusiveMaximum")
    for v in (lo, hi, xlo, xhi):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise SchemaError(f"{v!r} is not a number")
    eps = 1 if integer else 1e-3
    if isinstance(xlo, (int, float)) and not isinstance(xlo, bool):
        lo = max(lo, xlo + eps) if lo is not None else xlo + eps
    if isinstance(xhi, (int, float)) and not isinstance(xhi, bool):
        hi = min(hi, xhi - eps) if hi is not None else xhi - eps
    if lo is None and hi is None:
        lo, hi = 0, 100
    elif lo is None:
        lo = hi - 100
    elif hi is None:
        hi = lo + 100
    if integer:  # JSON integers as int64, what every client (and orjson) can carry
        lo, hi = max(int(-(-lo // 1)), -(2**63)), min(int(hi // 1), 2**63 - 1)
    if hi < lo:
        raise SchemaError("minimum is greater than maximum")
    return lo, hi


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        if k == "properties" and isinstance(v, dict):
            out["properties"] = {**(out.get("properties") or {}), **v}
        elif k == "required" and isinstance(v, list):
            out["required"] = list(dict.fromkeys([*(out.get("required") or []), *v]))
        else:
            out.setdefault(k, v)
    return out
