"""The base of every typed config model: unknown fields are errors, values are immutable once loaded."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def sha256_hex_list(v: list[str]) -> list[str]:
    """Validate API-key/token digests: sha256 hex (an optional `sha256:` prefix is dropped), never a raw secret."""
    out = []
    for h in v:
        h = h.removeprefix("sha256:").lower()
        if len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
            raise ValueError("each entry must be a sha256 hex digest (64 hex chars), never a raw key")
        out.append(h)
    return out


def _http_url(v: str) -> str:
    if not v.startswith(("http://", "https://")):
        raise ValueError("must start with http:// or https://")
    return v.rstrip("/")


# A URL the gateway connects to (a replica, a hosted endpoint, a prefill server): http(s) only, no trailing slash.
HttpUrl = Annotated[str, AfterValidator(_http_url)]


def unique_names(names: list[str], what: str) -> None:
    """A config list whose entries are addressed by name: a name given twice is an error naming the list."""
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{what}: duplicate names {dup}")

