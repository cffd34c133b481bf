"""Responses tools <-> chat function tools, pure: function, custom (free-form) and namespace tools become chat
functions (a namespace's as `<namespace>__<name>`, a custom tool as a function taking one string `input`), hosted
tools no pool runs are left out or refused per the tenant's `hosted_tools`, and a tool_choice follows its tool."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.api.dropped import Dropped
from gateway.errors import InvalidRequest


def _bad(msg: str, param: str) -> InvalidRequest:
    return InvalidRequest(msg, param=param)


NS_SEP = "__"  # a namespace's tool `ns`/`name` is the chat function `ns__name` (chat names allow [A-Za-z0-9_-])


CUSTOM_PARAMS = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}


@dataclass(frozen=True)
class ToolName:
    """What a chat function name stands for: a plain function, a namespace's tool, or a custom tool."""

    name: str
    namespace: str | None = None
    custom: bool = False


# -- tools ---------------------------------------------------------------------------------------------------
def _function(t: dict[str, Any], where: str, names: dict[str, ToolName], namespace: str | None) -> dict[str, Any]:
    if not isinstance(t.get("name"), str) or not t["name"]:
        raise _bad(f"{where}.name must be a non-empty string.", f"{where}.name")
    custom = t.get("type") == "custom"
    flat = f"{namespace}{NS_SEP}{t['name']}" if namespace else t["name"]
    fn: dict[str, Any] = {"name": flat}
    if isinstance(t.get("description"), str):
        fn["description"] = t["description"]
    if custom:  # free-form input (a grammar or plain text): one string argument
        fn["parameters"] = CUSTOM_PARAMS
    else:
        for k in ("parameters", "strict"):
            if t.get(k) is not None:
                fn[k] = t[k]
    if namespace or custom:
        names[flat] = ToolName(t["name"], namespace, custom)
    return {"type": "function", "function": fn}


def chat_tools(tools: Any, dropped: Dropped | None = None, hosted_tools: str = "drop",
               names: dict[str, ToolName] | None = None) -> list[dict[str, Any]] | None:
    """Function, custom and namespace tools as chat functions (`names` learns what the flattened ones stand for);
    any other type runs on the provider's side (web_search, file_search, mcp, ...): left out, or refused with
    `hosted_tools: refuse`."""
    dropped = dropped if dropped is not None else Dropped()
    names = names if names is not None else {}
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("'tools' must be an array.", "tools")
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        kind = t.get("type") if isinstance(t, dict) else None
        if not isinstance(t, dict) or not isinstance(kind, str):
            raise _bad(f"{where}.type must be a string.", f"{where}.type")
        if kind in ("function", "custom"):
            out.append(_function(t, where, names, None))
        elif kind == "namespace":
            ns, inner = t.get("name"), t.get("tools")
            if not isinstance(ns, str) or not ns or not isinstance(inner, list):
                raise _bad(f"{where}: a namespace needs a 'name' and a 'tools' array.", where)
            for j, sub in enumerate(inner):
                w = f"{where}.tools[{j}]"
                if not isinstance(sub, dict) or sub.get("type") not in ("function", "custom"):
                    raise _bad(f"{w}.type must be 'function' or 'custom'.", f"{w}.type")
                out.append(_function(sub, w, names, ns))
        elif hosted_tools == "refuse":
            raise _bad(f"{where}: tools of type {kind!r} run on the provider's servers and are not supported by "
                       "this gateway's pools.", f"{where}.type")
        else:
            dropped.add(where, "hosted_tool")
    return out or None


def tool_name(flat: str, names: dict[str, ToolName] | None) -> ToolName:
    return (names or {}).get(flat) or ToolName(flat)


def chat_tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom") and isinstance(choice.get("name"), str):
        name = choice["name"]
        if isinstance(choice.get("namespace"), str) and choice["namespace"]:
            name = f"{choice['namespace']}{NS_SEP}{name}"
        return {"type": "function", "function": {"name": name}}
    raise _bad("'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...}.",
               "tool_choice")


def additional_tools(items: list[dict[str, Any]], dropped: Dropped, hosted_tools: str,
                      names: dict[str, ToolName]) -> list[dict[str, Any]]:
    """The tools `additional_tools` items declare (in order; a later declaration of a name replaces an earlier
    one). A chat request declares tools once, so they join the request's own."""
    by_name: dict[str, dict[str, Any]] = {}
    for k, item in enumerate(items):
        if item.get("type") != "additional_tools":
            continue
        sub = Dropped()
        for t in chat_tools(item["tools"], sub, hosted_tools, names) or []:
            by_name[t["function"]["name"]] = t
        for where, kind in sub.entries:
            dropped.add(f"additional_tools[{k}].{where}", kind)
    return list(by_name.values())


def choice_of(choice: Any, tools: list[dict[str, Any]] | None, raw_tools: Any, dropped: Dropped) -> Any:
    """`tool_choice`, unless it needs or names a tool that was left out (a hosted one): then it is left out too."""
    if choice is None or choice in ("auto", "none") or not raw_tools:
        return choice
    offered = {t["function"]["name"] for t in tools or []}
    named = chat_tool_choice(choice) if isinstance(choice, dict) and choice.get("type") in ("function", "custom") \
        else None
    if (named is None and isinstance(choice, dict)) or not offered or \
            (named is not None and named["function"]["name"] not in offered):
        dropped.add("tool_choice", "tool_choice")
        return None
    return choice
