"""The on-call console: one static page (`console.html`) over the admin API, served at `/console` wherever the admin
API is served. The page holds no data: it asks for the admin token and reads everything from `/admin/*` with it, so
a wrong token gets the API's 401 and nothing else; changes go through the same audited admin calls as the CLI,
each behind a confirmation. No build step: plain HTML and JavaScript, read once at import of this module's first
request."""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter
from starlette.responses import HTMLResponse, RedirectResponse, Response

router = APIRouter()

# The page runs only its own inline script and talks only to this origin; no framing (clickjacking an action).
HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "connect-src 'self'; img-src 'self'; form-action 'none'; frame-ancestors 'none'",
    "x-frame-options": "DENY", "cache-control": "no-store", "referrer-policy": "no-referrer",
}


@cache
def _page() -> str:
    return resources.files("gateway.api.admin").joinpath("console.html").read_text(encoding="utf-8")


@router.get("/console")
async def console() -> Response:
    return HTMLResponse(_page(), headers=HEADERS)


@router.get("/console/")
async def console_slash() -> Response:
    return RedirectResponse("/console")
