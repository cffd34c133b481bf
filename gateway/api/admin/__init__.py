"""The admin surface: the admin API (`routes.py`, `changes.py`) and the on-call console (`console.py`). `router`
holds all of it, so wherever the admin API is served the console is served beside it."""

from fastapi import APIRouter

from gateway.api.admin import changes, console, fleet, recording, routes

router = APIRouter()
for _part in (routes.router, changes.router, recording.router, fleet.router, console.router):
    router.include_router(_part)
