"""Providers without an OpenAI-compatible endpoint, through litellm.

litellm is heavy (~3 s import, ~350 MiB), so it is imported here, on first use of a `litellm` pool, never on
the hot path of the other pool kinds. Install with the `litellm` extra.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import AsyncIterator
from typing import Any

import orjson

from gateway.backends.base import AttemptFailed, Opened, UpstreamCall
from gateway.upstreams import Target


class LiteLLMBackend:
    def __init__(self) -> None:
        self._litellm: Any = None

    def _lib(self) -> Any:
        if self._litellm is None:
            # Use the bundled price map: otherwise importing litellm fetches one over the network first.
            os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
            try:
                self._litellm = importlib.import_module("litellm")
            except ImportError:
                raise AttemptFailed("the litellm pool kind needs the 'litellm' extra installed") from None
        return self._litellm

    async def open(self, target: Target, call: UpstreamCall) -> Opened:
        lib = self._lib()
        body = dict(call.body)
        body["model"] = target.upstream_model
        kwargs: dict[str, Any] = {"api_key": target.api_key, "timeout": call.first_byte_timeout}
        if target.base_url:
            kwargs["api_base"] = target.base_url
        fn = lib.acompletion if call.endpoint == "chat/completions" else lib.atext_completion
        try:
            result = await fn(**body, **kwargs)
            if not call.stream:
                return Opened(None, None, _plain(result), _noop)
            it = result.__aiter__()
            first = await it.__anext__()
        except AttemptFailed:
            raise
        except StopAsyncIteration:
            raise AttemptFailed("provider stream ended before any event") from None
        except Exception as e:  # noqa: BLE001 - litellm raises provider-specific classes; map by status code
            status = getattr(e, "status_code", None)
            raise AttemptFailed(f"{type(e).__name__}: {getattr(e, 'message', str(e))[:300]}",
                                status=status) from None
        return Opened(orjson.dumps(_plain(first)), _rest(it), None, _noop)


async def _rest(it: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    async for chunk in it:
        yield orjson.dumps(_plain(chunk))
    yield b"[DONE]"


def _plain(obj: Any) -> dict[str, Any]:
    if hasattr(obj, "model_dump"):
        return obj.model_dump(exclude_none=False)  # type: ignore[no-any-return]
    return dict(obj)


async def _noop() -> None:
    return None
