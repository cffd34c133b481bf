"""The simulator against real SGLang: the same requests to both, and what the gateway can observe compared.

`compare(real, sim)` sends each probe to a real server and to a `gateway sim` replica started with the same flags
and release, and returns one row per observable: status codes and error bodies for bad input, usage and
`cached_tokens` per request (prompts given as token ids, so both count the same tokens), `/server_info` and
`/v1/loads` fields the gateway reads (gateway/preflight.py, backends/engine_poller.py), the endpoints it calls,
`/metrics` names, and the KV-event stream (hashes, parents, token ids, salt) for the same token ids.
A row's `same` says whether they agree; `KNOWN` names the differences kept on purpose (docs/simulator.md), so a
test can fail on any other. `gateway engines diff --out FILE` writes the report.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import zmq

from gateway.preflight import ServerFacts


@dataclass(frozen=True)
class Endpoint:
    url: str
    kv: str  # the KV-event PUB to dial


@dataclass
class Row:
    area: str
    item: str
    real: str
    sim: str
    same: bool
    note: str = ""


# differences kept on purpose, by (area, item): each is explained in docs/simulator.md ("Against real SGLang")
KNOWN: dict[tuple[str, str], str] = {
    ("/metrics", "sglang:* series only in the real server"):
        "kept: the simulator exports the series its dashboards and load tests read; the gateway reads none "
        "(load comes from /v1/loads)",
    ("/metrics", "sglang:* series only in the simulator"):
        "kept: prometheus_client's *_created samples and series real SGLang registers only once used",
    **{("KV events", f"BlockStored pages, salt {salt!r}: pages past the prompt (generated tokens)"):
       "kept: the simulator caches a request's prompt pages only; SGLang also caches the generated tokens' KV when "
       "the request finishes, which fills a page of its own only with 1-token pages (0.5.13 on the CPU)"
       for salt in (None, "tenant-a")},
}

SERVER_INFO_KEYS = ("version", "dp_size", "attn_dp_size", "enable_dp_attention", "page_size", "context_length",
                    "max_req_input_len", "enable_cache_report", "enable_priority_scheduling", "default_priority_value",
                    "abort_on_priority_when_disabled", "schedule_low_priority_values_first", "schedule_policy",
                    "max_total_num_tokens")
LOAD_KEYS = ("dp_rank", "num_running_reqs", "num_waiting_reqs", "num_waiting_uncached_tokens")
ENDPOINTS = ("/ping", "/health", "/server_info", "/get_server_info", "/model_info", "/v1/loads", "/get_load",
             "/version", "/kv_event_sources", "/v1/models")


def bad_inputs(model: str) -> list[tuple[str, str, Any, dict[str, str]]]:
    """(name, path, body: dict or raw bytes, headers) of requests a client gets wrong. Each asks for one token, so
    an engine that accepts a wrong field answers at once instead of decoding to the end of the context."""
    msgs = [{"role": "user", "content": "hi"}]
    chat, comp = "/v1/chat/completions", "/v1/completions"
    one = {"model": model, "max_tokens": 1}
    return [
        ("body not JSON", chat, b"{not json", {"content-type": "application/json"}),
        ("content-type text/plain", chat, b'{"model":"m"}', {"content-type": "text/plain"}),
        ("messages missing", chat, {**one}, {}),
        ("messages not a list", chat, {**one, "messages": "hi"}, {}),
        ("messages empty", chat, {**one, "messages": []}, {}),
        ("role unknown", chat, {**one, "messages": [{"role": "wizard", "content": "hi"}]}, {}),
        ("max_tokens -1", chat, {"model": model, "messages": msgs, "max_tokens": -1}, {}),
        # a prompt near the context, so an engine that accepts the excess decodes only a few tokens before the end
        ("max_tokens past the context", comp, {"model": model, "prompt": [5] * 4000, "max_tokens": 100_000}, {}),
        ("temperature -1", chat, {**one, "messages": msgs, "temperature": -1}, {}),
        ("top_p 2", chat, {**one, "messages": msgs, "top_p": 2}, {}),
        ("n 0", chat, {**one, "messages": msgs, "n": 0}, {}),
        ("stream not a bool", chat, {**one, "messages": msgs, "stream": "yes"}, {}),
        ("model unknown", chat, {**one, "model": "no-such-model", "messages": msgs}, {}),
        ("prompt missing", comp, {**one}, {}),
        ("prompt empty list", comp, {**one, "prompt": []}, {}),
        # not sent: a token id past the vocabulary kills real SGLang 0.5.23's scheduler (IndexError on the CPU
        # path), the whole server with it (docs/results/2026-11-27-differential.md)
        ("prompt over the context", comp, {**one, "prompt": [5] * 5000}, {}),
    ]


def gateway_bad_inputs(model: str) -> list[tuple[str, str, Any, dict[str, str]]]:
    """`bad_inputs` addressed to a gateway (its public model name), plus what only a gateway can refuse safely: a
    token id past the vocabulary (sent bare, it kills real SGLang's scheduler; the gateway's pool `vocab_size`
    stops it) and a priority out of the engines' int64 range."""
    comp = "/v1/completions"
    return [*bad_inputs(model),
            ("token id past the vocabulary", comp, {"model": model, "prompt": [5, 10_000_000], "max_tokens": 1}, {}),
            ("priority past int64", comp, {"model": model, "prompt": "hi", "max_tokens": 1, "priority": 2**63}, {})]


def gateway_shape(r: httpx.Response) -> str:
    """A gateway's answer as status, error type, code and param (the gateway answers in OpenAI's error shape)."""
    return _shape(r, param=True)


def compare_gateways(real_gw: str, sim_gw: str, headers: dict[str, str], model: str) -> list[Row]:
    """The same bad input sent to a gateway in front of real SGLang and to one in front of the simulator: one row per
    probe, status and error shape (what a client of the gateway sees)."""
    rows = []
    with httpx.Client(timeout=120) as c:
        for name, path, body, h in gateway_bad_inputs(model):
            a = gateway_shape(_send(c, real_gw, path, body, {**headers, **h}))
            b = gateway_shape(_send(c, sim_gw, path, body, {**headers, **h}))
            rows.append(Row("bad input through the gateway", name, a, b, a == b))
    return rows


def _shape(r: httpx.Response, param: bool = False) -> str:
    try:
        body = r.json()
    except ValueError:
        return f"{r.status_code} (not JSON)"
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        e = body["error"]
        named = f", param={e.get('param')}" if param else ""
        return f"{r.status_code} error{{type={e.get('type')}, code={e.get('code')}{named}}}"
    if isinstance(body, dict) and body.get("object") == "error":
        return f"{r.status_code} object=error{{type={body.get('type')}, code={body.get('code')}}}"
    if isinstance(body, dict) and "detail" in body:
        return f"{r.status_code} detail"
    return f"{r.status_code} {type(body).__name__}"


def _send(c: httpx.Client, base: str, path: str, body: Any, headers: dict[str, str]) -> httpx.Response:
    if isinstance(body, bytes):
        return c.post(base + path, content=body, headers=headers)
    return c.post(base + path, json=body, headers=headers)


class _Events:
    """A SUB on one publisher, collecting decoded events."""

    def __init__(self, endpoint: str) -> None:
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def drain(self, wait_s: float, want: int = 0) -> list[Any]:
        out: list[Any] = []
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                frames = self.sock.recv_multipart()
                out.extend(msgspec.msgpack.decode(frames[-1])[1])
                if want and sum(1 for e in out if _kind(e) == "BlockStored") >= want:
                    # the rest of the batch cadence: anything else already queued
                    while self.sock.poll(300):
                        out.extend(msgspec.msgpack.decode(self.sock.recv_multipart()[-1])[1])
                    break
        return out

    def close(self) -> None:
        self.sock.close(0)


def _kind(e: Any) -> str:
    return str(e.get("type")) if isinstance(e, dict) else str(e[0])


def _as_map(e: Any) -> dict[str, Any]:
    """A BlockStored in 0.5.23's tagged-map form; up to 0.5.13 it is a tagged array `["BlockStored", hashes, parent,
    tokens, block_size, lora_id, medium?]` (gateway/kvevents/wire.py) with no cache_salt."""
    if isinstance(e, dict):
        return e
    keys = ("type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
    return dict(zip(keys, e))


def _stored_view(events: list[Any]) -> list[tuple[Any, ...]]:
    """BlockStored events as comparable tuples (coalesced or not: one tuple per page), from either encoding."""
    pages: list[tuple[Any, ...]] = []
    for raw in events:
        if _kind(raw) != "BlockStored":
            continue
        e = _as_map(raw)
        bs = e.get("block_size") or 0
        hashes, parent, toks = e.get("block_hashes") or [], e.get("parent_block_hash"), e.get("token_ids") or []
        for i, h in enumerate(hashes):
            pages.append((h, parent if i == 0 else hashes[i - 1], tuple(toks[i * bs:(i + 1) * bs]),
                          bs, e.get("cache_salt"), e.get("medium")))
    return pages


def _from_root(pages: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The pages from the first one stored at the root on: the probe's prompt starts a chain of its own (after a
    flush, or in a salt's own tree), while a publisher may still send a few pages of the request before the flush
    after the SUB joined (0.5.13 with 1-token pages: the generated tokens, stored when that request finished)."""
    first = next((i for i, p in enumerate(pages) if p[1] is None), 0)
    return pages[first:]


def compare(real: Endpoint, sim: Endpoint, model: str = "tiny") -> list[Row]:
    rows: list[Row] = []

    def row(area: str, item: str, a: object, b: object, note: str = "") -> None:
        ra, sb = str(a), str(b)
        known = KNOWN.get((area, item), "")
        rows.append(Row(area, item, ra, sb, ra == sb, note or known))

    with httpx.Client(timeout=300) as c:
        # -- endpoints the gateway calls ---------------------------------------------------------------------------
        for path in ENDPOINTS:
            row("endpoint", f"GET {path}", c.get(real.url + path).status_code, c.get(sim.url + path).status_code)
        # -- /server_info and /v1/loads fields the gateway reads ---------------------------------------------------
        ri, si = c.get(real.url + "/server_info").json(), c.get(sim.url + "/server_info").json()
        for k in SERVER_INFO_KEYS:
            row("/server_info", k, ri.get(k, "absent"), si.get(k, "absent"))
        row("/server_info", "kv_events (keys)", sorted((ri.get("kv_events") or {}).keys()),
            sorted((si.get("kv_events") or {}).keys()))
        fr, fs = ServerFacts.from_info(ri), ServerFacts.from_info(si)
        row("/server_info", "facts the gateway derives",
            (fr.ranks, fr.page_size, fr.cache_report, fr.priority_scheduling, fr.default_priority_value),
            (fs.ranks, fs.page_size, fs.cache_report, fs.priority_scheduling, fs.default_priority_value))
        rl, sl = c.get(real.url + "/v1/loads").json(), c.get(sim.url + "/v1/loads").json()
        for k in LOAD_KEYS:
            row("/v1/loads", k, type((rl.get("loads") or [{}])[0].get(k)).__name__,
                type((sl.get("loads") or [{}])[0].get(k)).__name__)
        # -- bad input ---------------------------------------------------------------------------------------------
        for name, path, body, headers in bad_inputs(model):
            row("bad input", name, _shape(_send(c, real.url, path, body, headers)),
                _shape(_send(c, sim.url, path, body, headers)))
        # -- usage and cached_tokens, prompts as token ids ----------------------------------------------------------
        base = [(i * 37) % 1900 + 50 for i in range(200)]
        seq = [("200 ids", base), ("the same again", base), ("+100 ids", base + list(range(300, 400))),
               ("another 130 ids", list(range(1000, 1130))), ("the first 150 ids", base[:150])]
        for name, ids in seq:
            body = {"model": model, "prompt": ids, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
            ur = c.post(real.url + "/v1/completions", json=body).json().get("usage", {})
            us = c.post(sim.url + "/v1/completions", json=body).json().get("usage", {})

            def view(u: dict[str, Any]) -> tuple[Any, ...]:
                d = u.get("prompt_tokens_details") or {}
                return u.get("prompt_tokens"), d.get("cached_tokens"), u.get("completion_tokens")

            row("usage (prompt, cached, completion)", name, view(ur), view(us))
        # -- KV events for the same token ids ----------------------------------------------------------------------
        c.post(real.url + "/flush_cache")
        c.post(sim.url + "/flush_cache")
        er, es = _Events(real.kv), _Events(sim.kv)
        try:
            time.sleep(0.5)  # a SUB joins a little after connect (ZMQ's slow joiner): events before it are lost
            ids = [(i * 53) % 1900 + 60 for i in range(3 * 64 + 10)]
            for salt in (None, "tenant-a"):
                ev_body: dict[str, Any] = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0}
                if salt:
                    ev_body["cache_salt"] = salt
                c.post(real.url + "/v1/completions", json=ev_body)
                c.post(sim.url + "/v1/completions", json=ev_body)
                vr, vs = _from_root(_stored_view(er.drain(20, want=1))), _from_root(_stored_view(es.drain(20, want=1)))
                label = f"BlockStored pages, salt {salt!r}"
                # the prompt's pages are compared; pages past them hold generated tokens (the model's choice)
                n = len(ids) // (vr[0][3] if vr and vr[0][3] else 1)
                row("KV events", f"{label}: pages past the prompt (generated tokens)", len(vr[n:]), len(vs[n:]))
                vr, vs = vr[:n], vs[:n]
                row("KV events", f"{label}: count", len(vr), len(vs))
                row("KV events", f"{label}: hashes", [p[0] for p in vr], [p[0] for p in vs])
                row("KV events", f"{label}: parents", [p[1] for p in vr], [p[1] for p in vs])
                row("KV events", f"{label}: token ids equal", [p[2] == q[2] for p, q in zip(vr, vs)],
                    [True] * min(len(vr), len(vs)))
                row("KV events", f"{label}: block_size, cache_salt, medium", sorted({p[3:] for p in vr}),
                    sorted({p[3:] for p in vs}))
            c.post(real.url + "/flush_cache")
            c.post(sim.url + "/flush_cache")
            kr = [_kind(e) for e in er.drain(5)]
            ks = [_kind(e) for e in es.drain(5)]
            row("KV events", "after /flush_cache", kr, ks)
        finally:
            er.close()
            es.close()
        # -- /metrics names ----------------------------------------------------------------------------------------
        def names(url: str) -> set[str]:
            text = c.get(url + "/metrics").text
            return {line.split("{")[0].split(" ")[0] for line in text.splitlines()
                    if line.startswith("sglang:")}

        nr, ns = names(real.url), names(sim.url)
        row("/metrics", "sglang:* series only in the real server", sorted(nr - ns)[:40], "[]")
        row("/metrics", "sglang:* series only in the simulator", "[]", sorted(ns - nr)[:40])
    return rows


def _cell(s: str) -> str:
    return s.replace("|", "\\|")[:300]


def render(rows: list[Row], header: str) -> str:
    out = [header, "", "| area | observable | real SGLang | simulator | same | note |", "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r.area} | {_cell(r.item)} | {_cell(r.real)} | {_cell(r.sim)} | {'yes' if r.same else '**no**'} "
                   f"| {_cell(r.note)} |")
    same = sum(r.same for r in rows)
    out += ["", f"{same} of {len(rows)} observables the same; {len(rows) - same} differ."]
    return "\n".join(out) + "\n"


@contextmanager
def sim_twin(real: Any, model_dir: Any, version: str, ready_s: float = 60.0) -> Iterator[tuple[Endpoint, list[str]]]:
    """A `gateway sim` started with the same flags, page size and release as the real server `real` (a
    `servers.EngineServer`), on free ports, once it answers `/v1/models`: its endpoint and the argv it was started
    with. Ended on exit."""
    import subprocess
    import sys

    from gateway_lab.engines.recipes import ServerFlags, sim_argv
    from gateway_lab.engines.servers import free_port_pair

    port = free_port_pair({real.flags.port, real.flags.kv_port})
    kv = free_port_pair({port, port + 1, real.flags.port, real.flags.kv_port})
    argv = sim_argv(ServerFlags(port=port, kv_port=kv, model=str(model_dir), page_size=real.flags.page_size), version)
    sim = subprocess.Popen([sys.executable, "-c", "import sys; from gateway.cli import main; sys.exit(main(sys.argv[1:]))",
                            *argv], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + ready_s
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or sim.poll() is not None:
                raise RuntimeError("gateway sim did not start")
            time.sleep(0.2)
        yield Endpoint(f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{kv}"), argv
    finally:
        sim.terminate()
        sim.wait(10)


def run_diff(env: Any, model_dir: Any, logs: Any) -> str:
    """One real server and one `gateway sim` with the same flags, compared; the Markdown report."""
    from gateway_lab.engines.servers import running

    with running(env, str(model_dir), 1, logs) as fleet:
        real = fleet.servers[0]
        with sim_twin(real, model_dir, env.recipe.version, ready_s=30) as (sim, argv):
            rows = compare(Endpoint(real.url, real.kv_endpoint), sim)
    head = (f"Real SGLang {env.recipe.version} (engine kit, tiny model, CPU) against `gateway sim --sglang-version "
            f"{env.recipe.version}` with the same flags (`{' '.join(argv[1:])}`).")
    return render(rows, head)
