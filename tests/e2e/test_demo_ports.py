"""`gateway demo` and `gateway sim` next to other services (issue 16 item 3): two demos side by side both come up
(replica ports are picked free), and a port that is taken gives one line naming it and the flag, no traceback."""

import socket
import subprocess
import sys

import httpx
from openai import OpenAI

from tests.support import env_without_proxies, free_port, wait_http


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gateway.cli", *args], env=env_without_proxies(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()  # by our own PID
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_two_demos_side_by_side_both_serve():
    ports = [free_port(), free_port()]
    admin_ports = [free_port(), free_port()]  # explicit: each demo's API port + 1 may be the other's replica port
    procs = [_start("demo", "--port", str(p), "--admin-port", str(ap), "--time-scale", "20")
             for p, ap in zip(ports, admin_ports)]
    try:
        for p, proc in zip(ports, procs):
            wait_http(f"http://127.0.0.1:{p}/healthz", timeout=60, proc=proc)
        for p in ports:
            c = OpenAI(base_url=f"http://127.0.0.1:{p}/v1", api_key="sk-demo", max_retries=0)
            r = c.chat.completions.create(model="glm-5.2", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
            assert r.choices[0].message.content
        for ap in admin_ports:  # each demo's admin listener: /metrics and the admin API (the demo's token)
            assert httpx.get(f"http://127.0.0.1:{ap}/metrics").status_code == 200
            assert httpx.get(f"http://127.0.0.1:{ap}/admin/state",
                             headers={"authorization": "Bearer admin-demo"}).status_code == 200
    finally:
        for proc in procs:
            _end(proc)
    assert [proc.returncode for proc in procs] == [0, 0]


def _taken(cmd: list[str], port: int, flag: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        proc = _start(*cmd)
        try:
            out, err = proc.communicate(timeout=60)
        finally:
            _end(proc)
    assert proc.returncode == 2
    assert "Traceback" not in err and "Traceback" not in out
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert str(port) in lines[0] and "already in use" in lines[0] and flag in lines[0]


def test_a_taken_port_is_one_line_naming_it_and_the_flag():
    p = free_port()
    _taken(["demo", "--port", str(p)], p, "--port")
    _taken(["demo", "--port", str(free_port()), "--sim-port", str(p)], p, "--sim-port")
    _taken(["sim", "--port", str(p), "--replicas", "1"], p, "--port")
