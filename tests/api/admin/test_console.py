"""The on-call console in a real browser (the system's Chromium driven by Playwright): a wrong token is refused with
nothing shown; with the right one the overview marks the replica the simulator slowed 8x, on-call drains it behind
a confirmation, and undoes the drain from the history. Screenshots go to $GATEWAY_CONSOLE_SCREENSHOTS when set
(docs/images for the docs), else to the test's temporary directory.

Where no Chromium is installed (or Playwright is missing) the browser test is skipped, saying why; the page's own
contract (no data without a token, no framing) is checked over HTTP everywhere."""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from gateway.config import hash_key
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import start_sims, wait_until

ADM = {"authorization": "Bearer adm"}
SLOW = 8.0  # the slowed replica's every forward takes this many times longer


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.fixture(scope="module")
def fleet():
    """Three simulated replicas (the last slowed 8x through the simulator's fault switch) behind one gateway with
    in-memory state, and enough streamed traffic that each replica has observed TTFTs."""
    sims, _ = start_sims(3, time_scale=2.0)
    cfg = config([sglang_pool("p", sims.urls)], admin={"token_hashes": [hash_key("adm")]})
    gw = start_gateway(cfg)
    base = f"http://127.0.0.1:{gw.ports[0]}"
    httpx.post(f"{sims.urls[2]}/_sim/config", json={"slow_factor": SLOW}).raise_for_status()

    def one(i: int) -> None:
        with httpx.stream("POST", f"{base}/v1/chat/completions", headers={"authorization": f"Bearer {KEY_A}"},
                          json={"model": "glm-5.2", "stream": True, "max_tokens": 2,
                                "messages": [{"role": "user", "content": f"conversation {i}: " + "context " * 1500}]},
                          timeout=60) as r:
            for _ in r.iter_bytes():
                pass

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(36)))
    yield gw.admin_url  # the console and the admin API: the admin listener
    gw.stop()
    sims.stop()


def test_the_page_holds_no_data_and_the_api_refuses_a_wrong_token(fleet):
    page = httpx.get(f"{fleet}/console")
    assert page.status_code == 200 and "p-0" not in page.text and "tenant-a" not in page.text
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    for path in ("/admin/fleet", "/admin/tenants", "/admin/history", "/admin/decisions"):
        r = httpx.get(f"{fleet}{path}", headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401 and set(r.json()) == {"error"}, path


def test_the_overview_names_the_slow_replica(fleet):
    f = httpx.get(f"{fleet}/admin/fleet", headers=ADM).json()
    reps = {r["name"]: r for r in f["pools"][0]["replicas"]}
    assert [n for n, r in reps.items() if r["slow"]] == ["p-2"], reps
    assert all(r["observed_ttft_s"] is not None and r["predicted_served_ttft_s"] is not None and r["served"] > 0
               for r in reps.values())
    # the engines' KV-cache use, as their /v1/loads reports it (polled, so waited for)
    wait_until(lambda: all(0 <= (r["kv_usage"] if r["kv_usage"] is not None else -1) <= 1 for r in
                           httpx.get(f"{fleet}/admin/fleet", headers=ADM).json()["pools"][0]["replicas"]),
               timeout=20, what="KV use from every engine")


def test_console_in_a_real_browser_login_find_the_slow_replica_drain_undo(fleet, tmp_path: Path):
    exe = chromium()
    if exe is None:
        pytest.skip("no Chromium installed (apt-get install chromium): the console's browser test cannot run here")
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright): the console's browser test cannot run")
    shots = Path(os.environ.get("GATEWAY_CONSOLE_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1400, "height": 800})
        # conditions, not wall-clock luck: generous ceilings for a browser on a busy machine (defaults are 5 s)
        page.set_default_timeout(60_000)
        expect.set_options(timeout=60_000)
        try:
            page.goto(f"{fleet}/console")
            page.fill("#token", "wrong-token")
            page.click("button[type=submit]")
            expect(page.locator("#login-error")).to_contain_text("401")
            expect(page.locator("#app")).to_be_hidden()
            assert page.locator("tr[data-replica]").count() == 0  # nothing rendered
            page.screenshot(path=str(shots / "console-login-401.png"))

            page.fill("#token", "adm")
            page.fill("#actor", "oncall")
            page.click("button[type=submit]")
            slow = page.locator("tr.slow")
            expect(slow).to_have_count(1)
            assert slow.get_attribute("data-replica") == "p-2"
            page.screenshot(path=str(shots / "console-overview-slow.png"), full_page=True)

            slow.locator("button[data-drain]").click()
            expect(page.locator("#modal")).to_be_visible()
            expect(page.locator("#modal-title")).to_have_text("Drain p-2")
            page.screenshot(path=str(shots / "console-drain-confirm.png"))
            page.click("#modal-ok")
            expect(page.locator("#flash")).to_contain_text("Drain p-2: done")
            wait_until(lambda: httpx.get(f"{fleet}/admin/fleet", headers=ADM).json()["pools"][0]["replicas"][2]["drained"],
                       timeout=10, what="p-2 drained")
            expect(page.locator('tr[data-replica="p-2"]')).to_contain_text("drained")

            page.click("#tabs button[data-tab=history]")
            undo = page.locator("tr[data-audit] button[data-undo]").first
            expect(undo).to_be_visible()
            page.screenshot(path=str(shots / "console-history.png"))
            undo.click()
            expect(page.locator("#modal-title")).to_contain_text("drain p-2")
            page.click("#modal-ok")
            expect(page.locator("#flash")).to_contain_text("done")
            wait_until(lambda: not httpx.get(f"{fleet}/admin/fleet", headers=ADM).json()["pools"][0]["replicas"][2]["drained"],
                       timeout=10, what="p-2 undrained")
            expect(page.locator("tr[data-audit]").first).to_contain_text("undoes")
            page.screenshot(path=str(shots / "console-history-undone.png"))
            entries = httpx.get(f"{fleet}/admin/history", headers=ADM).json()["entries"]
            assert [e["what"] for e in entries[:2]] == ["undrain", "drain"] and entries[0]["undo_of"] == entries[1]["id"]
            assert entries[1]["who"].endswith("(oncall)")

            # a weight preview from the overview: computed from the recent decisions, nothing changed
            page.click("#tabs button[data-tab=overview]")
            page.fill("input[data-pool=p]", "0")
            page.click("text=Preview")
            expect(page.locator("#modal-title")).to_have_text("Set pool p weight to 0")
            expect(page.locator("#modal-body")).to_contain_text("would have no replica")
            page.screenshot(path=str(shots / "console-preview.png"))
            page.click("#modal-cancel")
            assert httpx.get(f"{fleet}/admin/fleet", headers=ADM).json()["pools"][0]["weight"] == 1  # cancelled

            # a tenant's limit changed from the tenants page, behind the confirmation
            page.click("#tabs button[data-tab=tenants]")
            page.locator('tr[data-tenant="tenant-a"] button').click()
            page.locator("#modal-body label", has_text="requests / min").locator("input").fill("900")
            page.screenshot(path=str(shots / "console-tenant-change.png"))
            page.click("#modal-ok")
            expect(page.locator("#flash")).to_contain_text("Tenant tenant-a: rate_limits")
            policy = httpx.get(f"{fleet}/admin/tenants/tenant-a/policy", headers=ADM).json()
            assert policy["effective"]["rate_limits"]["requests_per_minute"] == 900
            assert policy["live"] == {"rate_limits": {"requests_per_minute": 900}}  # only what was changed
            expect(page.locator('tr[data-tenant="tenant-a"]')).to_contain_text("/ 900")
            page.screenshot(path=str(shots / "console-tenants.png"))

            # an override: pin the tenant to a pool for an hour, after its preview
            page.locator('tr[data-tenant="tenant-a"] button').click()
            page.locator("#modal-body label", has_text="pin to pool").locator("input").fill("p")
            page.click("#modal-ok")
            expect(page.locator("#modal-title")).to_have_text("Pin tenant-a to p for 1 h?")
            expect(page.locator("#modal-body")).to_contain_text("would stay")  # one pool: nothing moves
            page.click("#modal-ok")
            expect(page.locator('tr[data-tenant="tenant-a"]')).to_contain_text('"pin_pool":"p"')
            state = httpx.get(f"{fleet}/admin/state", headers=ADM).json()
            assert state["tenant_overrides"]["tenant-a"]["pin_pool"] == "p"
        finally:
            browser.close()
