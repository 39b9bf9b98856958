"""The session browser (/ui/) as a tool for finding and understanding a session, in headless
Chromium: the list with front doors, metadata, errors and search snippets (hostile metadata
and code inserted as text only); search and filters sent to GET /v1/recordings and kept in
the address bar; a session's whole timeline (files, commands, network refusals, closes);
Interrupt, Restart and Delete on a live session, checked through the API; and the layout at
1280 and 1920 px, with screenshots (saved under $KB_SCREENSHOTS, else a pytest tmp dir) and
geometry from getBoundingClientRect."""
import asyncio
import os
import threading
import time
import uuid
from pathlib import Path

import pytest
import requests
from selenium.webdriver.common.by import By

from conftest import ALICE, BOB, needs_criu, wait_for
from test_ui import browser, execute, wait  # noqa: F401 (browser is a fixture)

HOSTILE = '<img src=x onerror="window.__pwned=1">'
LONG = "W" * 2048


# ---- helpers ----------------------------------------------------------------------------

def shots_dir(tmp_path):
    d = Path(os.environ.get("KB_SCREENSHOTS") or tmp_path / "screenshots")
    d.mkdir(parents=True, exist_ok=True)
    return d


def shoot(driver, tmp_path, name):
    path = shots_dir(tmp_path) / f"{name}.png"
    driver.save_screenshot(str(path))
    print("screenshot:", path)
    return path


def create_rest(b, metadata=None, token=ALICE):
    """A REST session, with `metadata` if given."""
    body = {"metadata": metadata} if metadata is not None else {}
    r = b.api("POST", "/v1/sessions", token, json=body)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def create_jupyter(b):
    r = b.api("POST", "/api/kernels", json={"name": "python3"})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def recordings(b, token=ALICE, **params):
    r = b.api("GET", "/v1/recordings", token, params=params)
    assert r.status_code == 200, r.text
    return r.json()


def front_door_of(b, sid):
    return next(r["front_door"] for r in recordings(b) if r["id"] == sid)


def closed_by(b, sid):
    """`by` of the session's recorded `session_closed` (None before the lead's change)."""
    r = b.api("GET", f"/v1/sessions/{sid}/events", params={"channel": "broker", "limit": 10000})
    assert r.status_code == 200, r.text
    closes = [e for e in r.json()["events"] if e.get("kind") == "session_closed"]
    return closes[-1].get("detail", {}).get("by") if closes else None


def open_page(driver, b, query="", sid=""):
    driver.get(f"{b.url}/ui/?token={ALICE}" + (("&" + query) if query else "") + (f"#{sid}" if sid else ""))
    wait(driver, lambda d: d.find_elements(By.ID, "session-list"), what="the page")


def listed(driver):
    return [li.get_attribute("data-id") for li in
            driver.find_elements(By.CSS_SELECTOR, "#session-list li.session")]


def entry(driver, sid):
    return driver.find_element(By.CSS_SELECTOR, f"#session-list li[data-id='{sid}']")


def kinds(driver):
    return [m.get_attribute("data-kind") for m in
            driver.find_elements(By.CSS_SELECTOR, "#timeline .marker")]


def marker(driver, kind):
    found = driver.find_elements(By.CSS_SELECTOR, f"#timeline .marker[data-kind='{kind}']")
    return found[0] if found else None


def rect(driver, e):
    return driver.execute_script("const r = arguments[0].getBoundingClientRect();"
                                 "return {l: r.left, t: r.top, r: r.right, b: r.bottom, w: r.width, h: r.height};", e)


def overlap(a, b):
    return min(a["r"], b["r"]) - max(a["l"], b["l"]) > 0.5 and min(a["b"], b["b"]) - max(a["t"], b["t"]) > 0.5


def no_overlaps(driver, elements, what):
    boxes = [(e.get_attribute("class") or e.tag_name, rect(driver, e)) for e in elements if e.is_displayed()]
    boxes = [(n, r) for n, r in boxes if r["w"] > 0 and r["h"] > 0]
    for i, (na, a) in enumerate(boxes):
        for nb, b in boxes[i + 1:]:
            assert not overlap(a, b), f"{what}: {na} {a} overlaps {nb} {b}"


def run_in_thread(fn):
    out = {}
    t = threading.Thread(target=lambda: out.update(result=fn()), daemon=True)
    t.start()
    return t, out


# ---- GET / --------------------------------------------------------------------------------

def test_the_root_leads_to_the_session_browser(broker):
    r = requests.get(broker.url + "/", allow_redirects=False, timeout=10)
    assert r.status_code == 307 and r.headers["location"] == "/ui/"
    r = requests.get(broker.url + f"/?token={ALICE}", timeout=10)
    assert r.status_code == 200 and r.url.endswith("/ui/?token=" + ALICE)
    assert "session-list" in r.text


# ---- the list, search and filters -----------------------------------------------------------

def test_the_list_shows_front_doors_metadata_errors_and_hostile_text_as_text(broker, browser, tmp_path):
    tag = uuid.uuid4().hex[:10]
    # Metadata values are at most 1 KiB: two long ones make 2 KiB.
    rest = create_rest(broker, {"agent": f"billing-{tag}", "evil": HOSTILE, "long": LONG[:1000], "more": LONG[:1000]})
    execute(broker, rest, f"print('rest-{tag}')")
    execute(broker, rest, f"raise KeyError('missing-{tag}')")
    execute(broker, rest, f"s = {HOSTILE!r} + {LONG!r}\nprint(s)")
    jup = create_jupyter(broker)
    execute(broker, jup, f"print('jupyter-{tag}')")

    open_page(browser, broker, f"q={tag}")
    wait(browser, lambda d: {rest, jup} <= set(listed(d)), what="both sessions")
    r = entry(browser, rest)
    assert r.find_element(By.CSS_SELECTOR, ".door").text == "REST"
    assert f"agent=billing-{tag}" in r.find_element(By.CSS_SELECTOR, ".meta").text
    errors = r.find_element(By.CSS_SELECTOR, ".errors")
    assert errors.text == "1 error" and "some" in errors.get_attribute("class")
    assert "ago" in r.find_element(By.CSS_SELECTOR, ".last").text or "just now" in r.text
    assert r.find_element(By.CSS_SELECTOR, ".last").get_attribute("title").startswith("last activity ")
    j = entry(browser, jup)
    assert j.find_element(By.CSS_SELECTOR, ".door").text == "Jupyter"
    assert "some" not in j.find_element(By.CSS_SELECTOR, ".errors").get_attribute("class")
    # Search snippets, the matched text marked.
    snippets = r.find_elements(By.CSS_SELECTOR, ".match")
    assert 1 <= len(snippets) <= 3
    assert any(tag in m.find_element(By.CSS_SELECTOR, "mark").text.lower() for m in snippets)

    # Hostile metadata and code: text, no element made of them, nothing run, nothing wider
    # than the list.
    assert not browser.find_elements(By.CSS_SELECTOR, "#sessions img, #detail img[src='x']")
    assert browser.execute_script("return window.__pwned") is None
    nav = rect(browser, browser.find_element(By.ID, "sessions"))
    for li in browser.find_elements(By.CSS_SELECTOR, "#session-list li.session"):
        assert rect(browser, li)["r"] <= nav["r"] + 1, "an entry wider than the list"
    assert browser.execute_script("const n = document.getElementById('sessions');"
                                  "return n.scrollWidth <= n.clientWidth + 1"), "the list scrolls sideways"
    shoot(browser, tmp_path, "list-hostile-1280")

    # E2B and MCP, when their clients are here.
    e2b_ci = pytest.importorskip("e2b_code_interpreter")
    os.environ.update(E2B_API_URL=broker.url + "/e2b", E2B_SANDBOX_URL=broker.url + "/e2b/sandbox",
                      E2B_API_KEY=ALICE)
    with e2b_ci.Sandbox.create(timeout=300, metadata={"team": f"e2b-{tag}"}) as sbx:
        sbx.run_code(f"print('e2b-{tag}')")
        wait(browser, lambda d: sbx.sandbox_id in listed(d), timeout=15, what="the sandbox")
        e = entry(browser, sbx.sandbox_id)
        assert e.find_element(By.CSS_SELECTOR, ".door").text == "E2B"
        assert f"team=e2b-{tag}" in e.find_element(By.CSS_SELECTOR, ".meta").text
    pytest.importorskip("mcp")
    from test_mcp import http_client

    async def through_mcp():
        async with http_client(broker) as client:
            await client.call_tool("run_python", {"code": f"print('mcp-{tag}')"})
    asyncio.run(through_mcp())
    made = [r for r in recordings(broker, q=f"mcp-{tag}") if r["front_door"] == "mcp"]
    assert len(made) == 1, made
    wait(browser, lambda d: made[0]["id"] in listed(d), timeout=15, what="the MCP session")
    m = entry(browser, made[0]["id"])
    assert m.find_element(By.CSS_SELECTOR, ".door").text == "MCP"
    client = made[0]["metadata"].get("client")
    assert client and client in m.find_element(By.CSS_SELECTOR, ".meta").text, made[0]


def test_hostile_code_output_and_file_names_stay_text(broker, browser, tmp_path):
    sid = create_rest(broker)
    execute(broker, sid, f"s = {HOSTILE!r} + {LONG!r}\nprint(s)\n{HOSTILE!r}")
    name = 'x<img src=x onerror="window.__pwned=2">' + "N" * 200 + ".txt"
    r = broker.api("PUT", f"/v1/sessions/{sid}/files/" + requests.utils.quote(name), data=b"hi")
    assert r.status_code == 201, r.text
    open_page(browser, broker, sid=sid)
    wait(browser, lambda d: marker(d, "file_written"), what="the upload in the timeline")
    cell = browser.find_element(By.CSS_SELECTOR, "#timeline .cell")
    assert HOSTILE in cell.find_element(By.CSS_SELECTOR, ".code").text
    assert HOSTILE + LONG in cell.find_element(By.CSS_SELECTOR, ".stream.stdout").text
    assert "onerror" in marker(browser, "file_written").text
    assert not browser.find_elements(By.CSS_SELECTOR, "img[src='x']")
    assert browser.execute_script("return window.__pwned") is None
    for scroller in ("detail", "sessions"):
        assert browser.execute_script("const n = document.getElementById(arguments[0]);"
                                      "return n.scrollWidth <= n.clientWidth + 1", scroller), f"#{scroller} scrolls sideways"
    assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
    shoot(browser, tmp_path, "hostile-1280")


def test_search_and_filters_are_sent_and_kept_in_the_address_bar(broker, browser, tmp_path):
    tag = uuid.uuid4().hex[:10]
    ok = create_rest(broker, {"purpose": f"ok-{tag}"})
    execute(broker, ok, f"value_{tag} = 41\nprint('out-' + '{tag}'.upper())")
    bad = create_rest(broker)
    execute(broker, bad, f"class Err{tag}(Exception): pass\nraise Err{tag}('boom')")
    jup = create_jupyter(broker)
    execute(broker, jup, f"print('jup-{tag}')")
    assert broker.api("DELETE", f"/api/kernels/{jup}").status_code == 204

    open_page(browser, broker)
    wait(browser, lambda d: {ok, bad} <= set(listed(d)), what="the sessions")

    def search(text):
        q = browser.find_element(By.ID, "q")
        q.clear()
        q.send_keys(text + "\n")
        # The list shows this search's answer, not the one before.
        want = "q=" + requests.utils.quote(text, safe="")
        wait(browser, lambda d: d.find_element(By.ID, "session-list").get_attribute("data-query")
             .split("?")[-1].split("&")[0] == want, what=f"the answer to {text}")

    # By code, by output, by error name.
    search(f"value_{tag}")
    wait(browser, lambda d: listed(d) == [ok], what="the search by code")
    assert entry(browser, ok).find_element(By.CSS_SELECTOR, ".match").get_attribute("data-field") == "code"
    search(f"OUT-{tag.upper()}")
    wait(browser, lambda d: listed(d) == [ok], what="the search by output")
    assert "output" in [m.get_attribute("data-field") for m in
                        entry(browser, ok).find_elements(By.CSS_SELECTOR, ".match")]
    search(f"Err{tag}")
    wait(browser, lambda d: listed(d) == [bad], what="the search by error name")
    # Typing alone searches too, once the typing stops.
    q = browser.find_element(By.ID, "q")
    q.clear()
    q.send_keys(f"jup-{tag}")
    wait(browser, lambda d: listed(d) == [jup], what="the debounced search")
    assert f"q=jup-{tag}" in browser.current_url

    # Nothing found: said plainly.
    search(f"nothing-{tag}")
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#session-list li.empty"), what="the empty result")
    assert "No sessions match" in browser.find_element(By.CSS_SELECTOR, "#session-list li.empty").text

    # Each filter, with the search text `tag` (in all three sessions' code or output).
    search(tag)
    wait(browser, lambda d: set(listed(d)) == {ok, bad, jup}, what="all three")
    shoot(browser, tmp_path, "search-1280")

    def select(id_, value, expect, what):
        browser.execute_script("const s = document.getElementById(arguments[0]); s.value = arguments[1];"
                               "s.dispatchEvent(new Event('change'));", id_, value)
        wait(browser, lambda d: set(listed(d)) == expect, what=what)

    select("f-has-errors", "true", {bad}, "has_errors=true")
    select("f-has-errors", "false", {ok, jup}, "has_errors=false")
    select("f-has-errors", "", {ok, bad, jup}, "errors or not")
    assert (front_door_of(broker, jup), front_door_of(broker, ok)) == ("jupyter", "rest")
    select("f-front-door", "jupyter", {jup}, "front_door=jupyter")
    select("f-front-door", "rest", {ok, bad}, "front_door=rest")
    select("f-front-door", "", {ok, bad, jup}, "any front door")
    select("f-state", "live", {ok, bad}, "state=live")
    select("f-state", "ended", {jup}, "state=ended")
    select("f-state", "closed", {jup}, "state=closed")
    select("f-state", "expired", set(), "state=expired")
    select("f-state", "live", {ok, bad}, "state=live again")
    # A time range: until a minute ago holds none of them; since a minute ago all.
    browser.execute_script(
        "const i = document.getElementById('f-until'); const d = new Date(Date.now() - 3600e3);"
        "const p = (n) => String(n).padStart(2, '0');"
        "i.value = d.getFullYear() + '-' + p(d.getMonth() + 1) + '-' + p(d.getDate()) + 'T' + p(d.getHours()) + ':' + p(d.getMinutes());"
        "i.dispatchEvent(new Event('change'));")
    wait(browser, lambda d: listed(d) == [], what="until an hour ago")
    assert "until=" in browser.current_url
    browser.execute_script("const i = document.getElementById('f-until'); i.value = '';"
                           "i.dispatchEvent(new Event('change'));")
    wait(browser, lambda d: set(listed(d)) == {ok, bad}, what="no end of the range")

    # A reload keeps the search and the filters, in the form and in the list.
    url = browser.current_url
    assert f"q={tag}" in url and "state=live" in url
    browser.refresh()
    wait(browser, lambda d: set(listed(d)) == {ok, bad}, what="the list after a reload")
    assert browser.find_element(By.ID, "q").get_attribute("value") == tag
    assert browser.find_element(By.ID, "f-state").get_attribute("value") == "live"
    # A shared link (a new tab that has the token) opens the same list.
    browser.get(url.split("#")[0] + "&front_door=rest&has_errors=true")
    wait(browser, lambda d: listed(d) == [bad], what="the shared link's list")
    assert browser.find_element(By.ID, "f-has-errors").get_attribute("value") == "true"
    assert browser.find_element(By.ID, "f-front-door").get_attribute("value") == "rest"

    # Bad values from a link: the server's 400 is shown, naming the parameter.
    browser.get(f"{broker.url}/ui/?since=yesterday")
    wait(browser, lambda d: "since" in d.find_element(By.ID, "status").text, what="the 400 message")
    assert "error" in browser.find_element(By.ID, "status").get_attribute("class")
    # Another user's sessions never appear, whatever the search.
    for params in ({"q": tag}, {"state": "live"}, {}):
        assert not {ok, bad, jup} & {r["id"] for r in recordings(broker, BOB, **params)}


# The page's side of the contract, whatever the server does with it: what it sends, and how
# it draws the contract's fields (answers stubbed in the page's fetch).
STUB = """
window.__sent = [];
const realFetch = window.fetch;
window.fetch = (url, opts) => {
  window.__sent.push(String(url));
  if (window.__answer && String(url).includes('v1/recordings')) {
    return Promise.resolve(new Response(JSON.stringify(window.__answer), {status: 200, headers: {'Content-Type': 'application/json'}}));
  }
  return realFetch(url, opts);
};
"""


def sent_recordings(driver):
    from urllib.parse import parse_qs, urlsplit
    urls = [u for u in driver.execute_script("return window.__sent") if "v1/recordings" in u]
    return {k: v[0] for k, v in parse_qs(urlsplit(urls[-1]).query).items()} if urls else None


def test_the_page_sends_the_search_and_filters_it_shows(broker, browser):
    open_page(browser, broker)
    browser.execute_script(STUB)
    q = browser.find_element(By.ID, "q")
    q.send_keys("KeyError\n")
    wait(browser, lambda d: (sent_recordings(d) or {}).get("q") == "KeyError", what="q sent")
    for id_, value, key in [("f-state", "expired", "state"), ("f-front-door", "e2b", "front_door"),
                            ("f-has-errors", "true", "has_errors")]:
        browser.execute_script("const s = document.getElementById(arguments[0]); s.value = arguments[1];"
                               "s.dispatchEvent(new Event('change'));", id_, value)
        wait(browser, lambda d: (sent_recordings(d) or {}).get(key) == value, what=f"{key} sent")
    browser.execute_script("const i = document.getElementById('f-since'); i.value = '2026-01-02T03:04';"
                           "i.dispatchEvent(new Event('change'));")
    wait(browser, lambda d: "since" in (sent_recordings(d) or {}), what="since sent")
    since = sent_recordings(browser)["since"]
    assert since.endswith("Z") and since.startswith("2026-01-0"), since
    assert sent_recordings(browser) == {"q": "KeyError", "state": "expired", "front_door": "e2b",
                                        "has_errors": "true", "since": since}
    url = browser.current_url
    for part in ("q=KeyError", "state=expired", "front_door=e2b", "has_errors=true", "since="):
        assert part in url, url
    # Clear empties the form, the request and the address bar.
    browser.find_element(By.ID, "f-clear").click()
    wait(browser, lambda d: sent_recordings(d) == {}, what="nothing sent")
    assert "?" not in browser.current_url.split("#")[0] or browser.current_url.split("#")[0].endswith("?")


def test_the_list_draws_the_contract_fields_as_text(broker, browser, tmp_path):
    sid = create_rest(broker)
    open_page(browser, broker)
    browser.execute_script(STUB)
    now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime(time.time() - 300))
    base = {"kernel": "python3", "created_at": now, "ended_at": None, "end_reason": None,
            "last_event_at": now, "cells": 3, "events": 40}
    answer = [
        {**base, "id": sid, "state": "idle", "live": True, "front_door": "e2b", "errors": 2, "ended_by": None,
         "metadata": {"team": "billing", "evil": HOSTILE, "long": LONG},
         "matches": [{"seq": 4, "field": "code", "snippet": "df['price'] " + HOSTILE},
                     {"seq": 9, "field": "error", "snippet": "KeyError: 'PRICE'"},
                     {"seq": 12, "field": "output", "snippet": LONG[:150] + " price"}]},
        {**base, "id": str(uuid.uuid4()), "state": "closed", "live": False, "front_door": "mcp", "errors": 0,
         "ended_by": "mcp", "metadata": {"client": "claude-code", "client_version": "2.1"}},
        {**base, "id": str(uuid.uuid4()), "state": "expired", "live": False, "front_door": None, "errors": 0,
         "ended_by": "idle_expiry", "metadata": {}},
    ]
    browser.execute_script("window.__answer = arguments[0];", answer)
    browser.find_element(By.ID, "q").send_keys("price\n")
    wait(browser, lambda d: len(listed(d)) == 3, what="the stubbed list")
    a, b, c = browser.find_elements(By.CSS_SELECTOR, "#session-list li.session")
    assert a.find_element(By.CSS_SELECTOR, ".door").text == "E2B"
    assert "team=billing" in a.find_element(By.CSS_SELECTOR, ".meta").text
    assert HOSTILE in a.find_element(By.CSS_SELECTOR, ".meta").get_attribute("textContent")
    errors = a.find_element(By.CSS_SELECTOR, ".errors")
    assert errors.text == "2 errors" and "some" in errors.get_attribute("class")
    assert a.find_element(By.CSS_SELECTOR, ".last").text == "5 min ago"
    assert "last activity" in a.find_element(By.CSS_SELECTOR, ".last").get_attribute("title")
    matches = a.find_elements(By.CSS_SELECTOR, ".match")
    assert [m.get_attribute("data-field") for m in matches] == ["code", "error", "output"]
    assert [m.text for m in matches[1].find_elements(By.CSS_SELECTOR, "mark")] == ["PRICE"]
    assert HOSTILE in matches[0].get_attribute("textContent")
    assert b.find_element(By.CSS_SELECTOR, ".door").text == "MCP"
    assert b.find_element(By.CSS_SELECTOR, ".meta").text == "claude-code 2.1"
    assert "ended by MCP" in b.text
    assert "some" not in b.find_element(By.CSS_SELECTOR, ".errors").get_attribute("class")
    assert not c.find_elements(By.CSS_SELECTOR, ".door") and not c.find_elements(By.CSS_SELECTOR, ".meta")
    assert "ended by idle expiry" in c.text
    assert not browser.find_elements(By.CSS_SELECTOR, "#sessions img")
    assert browser.execute_script("return window.__pwned") is None
    assert browser.execute_script("const n = document.getElementById('sessions');"
                                  "return n.scrollWidth <= n.clientWidth + 1"), "the list scrolls sideways"
    for li in (a, b, c):
        no_overlaps(browser, li.find_elements(By.CSS_SELECTOR, ":scope > *"), "list entry")
        for line in li.find_elements(By.CSS_SELECTOR, ":scope > .line"):
            no_overlaps(browser, line.find_elements(By.CSS_SELECTOR, ":scope > *"), "list entry line")
    shoot(browser, tmp_path, "list-contract-1280")
    # An empty answer says so.
    browser.execute_script("window.__answer = [];")
    browser.find_element(By.ID, "q").send_keys("x\n")
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#session-list li.empty"), what="the empty list")
    assert browser.find_element(By.CSS_SELECTOR, "#session-list li.empty").text == \
        "No sessions match this search and these filters."


def test_a_shared_link_keeps_its_search_and_session_through_the_sign_in(broker, browser):
    sid = create_rest(broker)
    # A fresh browser has no token: the sign-in form, then the link's list.
    browser.get(f"{broker.url}/ui/?q=share-me&state=live#{sid}")
    field = wait(browser, lambda d: d.find_elements(By.NAME, "token"), what="the token form")[0]
    field.send_keys(ALICE + "\n")
    wait(browser, lambda d: d.find_elements(By.ID, "q"), what="the page")
    wait(browser, lambda d: d.find_element(By.ID, "q").get_attribute("value") == "share-me", what="the search kept")
    assert browser.find_element(By.ID, "f-state").get_attribute("value") == "live"
    assert "token=" not in browser.current_url and "q=share-me" in browser.current_url
    wait(browser, lambda d: d.find_element(By.ID, "detail").get_attribute("data-session") == sid,
         what="the link's session open")
    # A reload (the token only in the tab's storage now) keeps them too.
    browser.refresh()
    wait(browser, lambda d: d.find_elements(By.ID, "q")
         and d.find_element(By.ID, "q").get_attribute("value") == "share-me", what="the search after a reload")
    assert "state=live" in browser.current_url


def test_the_search_parameters_are_checked(broker):
    create_rest(broker)
    for params, name in [({"q": "x" * 201}, "q"), ({"state": "asleep"}, "state"),
                         ({"front_door": "window"}, "front_door"), ({"has_errors": "yes"}, "has_errors"),
                         ({"since": "yesterday"}, "since"), ({"until": "2026-13-01T00:00:00Z"}, "until"),
                         ({"limit": "0"}, "limit"), ({"limit": "10001"}, "limit")]:
        r = broker.api("GET", "/v1/recordings", params=params)
        assert r.status_code == 400, (params, r.text)
        assert name in r.json()["error"]["message"], (params, r.text)


# ---- a session's timeline -----------------------------------------------------------------------

def test_the_timeline_shows_files_commands_and_the_close(broker, browser, tmp_path):
    e2b_ci = pytest.importorskip("e2b_code_interpreter")
    os.environ.update(E2B_API_URL=broker.url + "/e2b", E2B_SANDBOX_URL=broker.url + "/e2b/sandbox",
                      E2B_API_KEY=ALICE)
    sbx = e2b_ci.Sandbox.create(timeout=300)
    sid = sbx.sandbox_id
    try:
        sbx.run_code("x = 1")
        sbx.files.write("notes/a.txt", "hello")
        sbx.files.rename("notes/a.txt", "notes/b.txt")
        sbx.files.remove("notes/b.txt")
        with pytest.raises(Exception):  # the SDK raises on a non-zero exit
            sbx.commands.run("echo from-a-command; exit 3", timeout=60)
        open_page(browser, broker, sid=sid)
        wait(browser, lambda d: {"file_written", "file_renamed", "file_removed", "command"} <= set(kinds(d)),
             timeout=20, what="the file and command events")
        assert "notes/a.txt" in marker(browser, "file_written").text
        assert "5 B" in marker(browser, "file_written").text
        assert "notes/a.txt → notes/b.txt" in marker(browser, "file_renamed").text
        assert "notes/b.txt" in marker(browser, "file_removed").text
        cmd = marker(browser, "command")
        assert "echo from-a-command; exit 3" in cmd.find_element(By.CSS_SELECTOR, ".argv").text
        wait(browser, lambda d: "exit code 3" in marker(d, "command").text, what="the command's end")
        assert " s" in marker(browser, "command").text
        # What it printed, as command_ended keeps it.
        assert marker(browser, "command").find_element(By.CSS_SELECTOR, ".command-output.stdout").text == "from-a-command"
        # A command that keeps running says so.
        handle = sbx.commands.run("sleep 300", background=True)
        wait(browser, lambda d: any("running" in m.text for m in
                                    d.find_elements(By.CSS_SELECTOR, "#timeline .marker[data-kind='command']")),
             what="the running command")
        handle.kill()
        wait(browser, lambda d: not any("running" in m.text for m in
                                        d.find_elements(By.CSS_SELECTOR, "#timeline .marker[data-kind='command']")),
             what="the killed command's end")
        assert any("killed by signal" in m.text for m in
                   browser.find_elements(By.CSS_SELECTOR, "#timeline .marker[data-kind='command']"))
    finally:
        sbx.kill()
    wait(browser, lambda d: marker(d, "session_closed"), timeout=15, what="the close")
    closed = marker(browser, "session_closed").text
    assert closed_by(broker, sid) == "e2b"
    assert "session closed by the E2B API" in closed, closed
    assert marker(browser, "session_created")
    shoot(browser, tmp_path, "timeline-e2b-1280")


def test_the_timeline_shows_a_refused_network_request(fresh_broker, browser):
    b = fresh_broker(["--egress-allow", "example.org"])
    sid = create_rest(b)
    x = execute(b, sid, "import urllib.request\n"
                        "try:\n    urllib.request.urlopen('http://forbidden.example.net/', timeout=20)\n"
                        "except Exception as e:\n    print(type(e).__name__, e)")
    assert "403" in x["stdout"], x
    open_page(browser, b, sid=sid)
    wait(browser, lambda d: marker(d, "egress_refused"), what="the refusal")
    text = marker(browser, "egress_refused").text
    assert "network request refused" in text and "forbidden.example.net:80" in text, text
    assert "not allowed" in text


def test_the_timeline_shows_jupyter_letting_go_and_an_expiry(broker, browser):
    # Jupyter's DELETE on a session the REST API made lets go of it; the session goes on
    # (session_detached) until its owner ends it.
    sid = create_rest(broker)
    assert broker.api("DELETE", f"/api/kernels/{sid}").status_code == 204
    assert broker.api("GET", f"/v1/sessions/{sid}").status_code == 200
    open_page(browser, broker, sid=sid)
    wait(browser, lambda d: marker(d, "session_detached"), what="the detach")
    assert "the Jupyter API let go of the session; it goes on" in marker(browser, "session_detached").text
    assert browser.find_element(By.ID, "action-delete").is_displayed()
    assert broker.api("DELETE", f"/v1/sessions/{sid}").status_code == 204
    wait(browser, lambda d: marker(d, "session_closed"), what="the close")
    assert "session closed by the REST API" in marker(browser, "session_closed").text

    # An idle session that expires: the timeline says so, the state is expired, no actions.
    r = broker.api("POST", "/v1/sessions", json={"idle_timeout_seconds": 1})
    assert r.status_code == 201, r.text
    short = r.json()["id"]
    wait_for(lambda: broker.api("GET", f"/v1/sessions/{short}").status_code == 410, timeout=60, what="the expiry")
    open_page(browser, broker, sid=short)
    wait(browser, lambda d: marker(d, "session_expired"), what="the expiry in the timeline")
    wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, ".session-head .state").text == "expired",
         what="the expired state")
    assert not browser.find_element(By.CSS_SELECTOR, ".session-head .actions").is_displayed()


def test_the_timeline_draws_every_kind_of_event(broker, browser, tmp_path):
    """Events a test broker cannot easily produce (network allowed, a death, a broker
    restart, a gap, a cut command), answered by a stubbed events API."""
    open_page(browser, broker)
    sid = str(uuid.uuid4())
    t = lambda n: f"2026-11-27T03:00:{n:02d}.000000Z"  # noqa: E731
    ev = lambda n, kind, detail=None: {"seq": n, "time": t(n), "direction": "broker", "kind": kind,  # noqa: E731
                                       "detail": detail or {}}
    events = [
        ev(1, "session_created", {"kernel": "python3", "front_door": "mcp", "metadata": {"client": "claude-code"}}),
        ev(2, "egress_allowed", {"method": "CONNECT", "host": "pypi.org", "port": 443, "address": "151.101.0.223"}),
        ev(3, "egress_closed", {"host": "pypi.org", "port": 443, "bytes_sent": 900, "bytes_received": 40960, "seconds": 1.5}),
        ev(4, "egress_allowed", {"method": "GET", "host": "files.pythonhosted.org", "port": 443, "address": "x"}),
        ev(5, "egress_refused", {"method": "CONNECT", "host": "evil.example", "port": 443,
                                 "reason": "host not allowed by policy: evil.example"}),
        ev(6, "command_started", {"pid": 7, "argv": ["/bin/bash", "-l", "-c", HOSTILE], "cwd": "/workspace"}),
        ev(7, "command_ended", {"pid": 99, "exit_code": 0, "signal": None, "seconds": 0.5}),
        ev(8, "interrupt"),
        ev(9, "kernel_died", {"reason": "the kernel was killed because it ran out of memory (limit 256 MiB)"}),
        ev(10, "kernel_restarted", {"reason": "restart requested"}),
        ev(11, "broker_restarted", {"down_seconds": 3.2, "kernel_alive": True}),
        ev(12, "recording_gap", {"dropped": 12}),
        ev(13, "output_cut", {"msg_id": "m", "msg_type": "stream", "bytes": 70000000}),
        ev(14, "session_detached", {"by": "jupyter"}),
        ev(15, HOSTILE, {"x": HOSTILE}),
        ev(16, "session_closed", {"by": "mcp_session_ended"}),
    ]
    browser.execute_script(STUB + """
window.__events = arguments[0];
const stubbed = window.fetch;
window.fetch = (url, opts) => String(url).includes('/events?')
  ? Promise.resolve(new Response(JSON.stringify({events: String(url).includes('after=0') ? window.__events : [], next_after: null}),
      {status: 200, headers: {'Content-Type': 'application/json'}}))
  : stubbed(url, opts);
location.hash = arguments[1];
""", events, sid)
    wait(browser, lambda d: marker(d, "session_closed"), what="the stubbed timeline")
    assert kinds(browser) == ["session_created", "egress", "egress_refused", "command", "command", "interrupt",
                              "kernel_died", "kernel_restarted", "broker_restarted", "recording_gap",
                              "output_cut", "session_detached", HOSTILE, "session_closed"]
    assert "session created via MCP" in marker(browser, "session_created").text
    assert "claude-code" in marker(browser, "session_created").text
    group = marker(browser, "egress")
    assert "2 connections allowed, 1 closed" in group.text
    group.find_element(By.TAG_NAME, "summary").click()
    lines = [li.text for li in group.find_elements(By.CSS_SELECTOR, "li")]
    assert len(lines) == 3 and "allowed CONNECT pypi.org:443" in lines[0] and "received 40.0 KiB" in lines[1], lines
    assert "evil.example:443" in marker(browser, "egress_refused").text
    started, ended = browser.find_elements(By.CSS_SELECTOR, "#timeline .marker[data-kind='command']")
    assert HOSTILE in started.text and "no end recorded (cut off)" in started.text
    assert "its start was not recorded" in ended.text and "exit code 0" in ended.text
    assert "ran out of memory" in marker(browser, "kernel_died").text
    assert "down 3.20 s" in marker(browser, "broker_restarted").text
    assert "12 events not recorded" in marker(browser, "recording_gap").text
    assert "the Jupyter API let go of the session; it goes on" in marker(browser, "session_detached").text
    assert "session closed by the end of its MCP session" in marker(browser, "session_closed").text
    assert not browser.find_elements(By.CSS_SELECTOR, "img[src='x']")
    assert browser.execute_script("return window.__pwned") is None
    assert browser.find_element(By.CSS_SELECTOR, ".session-head .state").text == "closed"
    assert not browser.find_element(By.CSS_SELECTOR, ".session-head .actions").is_displayed()
    shoot(browser, tmp_path, "timeline-every-kind-1280")


# ---- actions on a live session --------------------------------------------------------------

def test_interrupt_restart_and_delete_from_the_page(broker, browser, tmp_path):
    sid = create_rest(broker)
    execute(broker, sid, "x = 42")
    open_page(browser, broker, sid=sid)
    wait(browser, lambda d: d.find_element(By.ID, "action-interrupt").is_displayed(), what="the actions")

    # Interrupt stops a long sleep. Clicked once the cell runs (it writes a file first): an
    # interrupt that reaches ipykernel before the cell begins is not the cell's.
    t, out = run_in_thread(lambda: execute(
        broker, sid, "import time\nopen('sleeping.txt', 'w').close()\ntime.sleep(600)"))
    wait_for(lambda: broker.api("GET", f"/v1/sessions/{sid}/files/sleeping.txt").status_code == 200,
             what="the cell to run")
    browser.find_element(By.ID, "action-interrupt").click()
    t.join(30)
    assert not t.is_alive(), "the interrupt did not stop time.sleep(600)"
    assert out["result"]["status"] == "interrupted", out
    wait(browser, lambda d: "interrupt sent" in d.find_element(By.ID, "status").text, what="the message")
    wait(browser, lambda d: marker(d, "interrupt"), what="the interrupt in the timeline")
    assert execute(broker, sid, "x")["results"][0]["data"]["text/plain"] == "42"

    # Restart asks first; cancelled, nothing happens; accepted, the variable is gone.
    browser.find_element(By.ID, "action-restart").click()
    browser.switch_to.alert.dismiss()
    assert execute(broker, sid, "x")["status"] == "ok"
    browser.find_element(By.ID, "action-restart").click()
    alert = browser.switch_to.alert
    assert "Restart" in alert.text
    alert.accept()
    wait(browser, lambda d: "restarted" in d.find_element(By.ID, "status").text, timeout=60, what="restarted")
    x = execute(broker, sid, "x")
    assert x["status"] == "error" and x["error"]["ename"] == "NameError", x
    wait(browser, lambda d: marker(d, "kernel_restarted"), what="the restart in the timeline")

    # A failure is shown, not swallowed: the session ended behind the page's back.
    other = create_rest(broker)
    open_page(browser, broker, sid=other)
    wait(browser, lambda d: d.find_element(By.ID, "action-interrupt").is_displayed(), what="the actions")
    assert broker.api("DELETE", f"/v1/sessions/{other}").status_code == 204
    browser.execute_script("document.getElementById('action-interrupt').click()")
    wait(browser, lambda d: "interrupt failed" in d.find_element(By.ID, "status").text, what="the failure")
    assert "error" in browser.find_element(By.ID, "status").get_attribute("class")
    wait(browser, lambda d: not d.find_element(By.ID, "action-interrupt").is_displayed(),
         what="the actions hidden once it ended")

    # Delete asks, then ends the session; the buttons are disabled while it runs and hidden after.
    open_page(browser, broker, sid=sid)
    wait(browser, lambda d: d.find_element(By.ID, "action-delete").is_displayed(), what="the actions")
    browser.find_element(By.ID, "action-delete").click()
    alert = browser.switch_to.alert
    assert "Delete" in alert.text
    alert.accept()
    wait(browser, lambda d: "deleted" in d.find_element(By.ID, "status").text, what="deleted")
    assert broker.api("GET", f"/v1/sessions/{sid}").status_code in (404, 410)
    wait(browser, lambda d: marker(d, "session_closed"), timeout=15, what="the close in the timeline")
    wait(browser, lambda d: not d.find_element(By.CSS_SELECTOR, ".session-head .actions").is_displayed(),
         what="the actions hidden")
    shoot(browser, tmp_path, "actions-after-delete")


def test_actions_are_disabled_while_a_request_runs(broker, browser):
    sid = create_rest(broker)
    open_page(browser, broker, sid=sid)
    wait(browser, lambda d: d.find_element(By.ID, "action-restart").is_displayed(), what="the actions")
    # The page's requests answer a second late, so that there is a while to look at.
    browser.execute_script("window.confirm = () => true; const f = window.fetch;"
                           "window.fetch = (...a) => new Promise((r) => setTimeout(r, 1500)).then(() => f(...a));")
    browser.find_element(By.ID, "action-restart").click()
    # Meanwhile every action button is disabled (Interrupt, Pause, Resume (hidden), Snapshot,
    # Restart, Delete).
    states = browser.execute_script(
        "return [...document.querySelectorAll('.session-head .actions button')].map((b) => b.disabled)")
    assert states == [True] * 6, states
    wait(browser, lambda d: "restarted" in d.find_element(By.ID, "status").text, timeout=60, what="restarted")
    assert not browser.find_element(By.ID, "action-delete").get_attribute("disabled")
    assert broker.api("DELETE", f"/v1/sessions/{sid}").status_code == 204


# ---- forks: "open live here", and a fork's parent in the list -----------------------------------

def create_checkpointed(b, token=ALICE):
    """A REST session that takes a checkpoint after every successful execution."""
    r = b.api("POST", "/v1/sessions", token, json={"checkpoint_every_execution": True})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def checkpoints(b, sid, token=ALICE):
    r = b.api("GET", f"/v1/sessions/{sid}/checkpoints", token)
    assert r.status_code == 200, r.text
    return {c["execution_count"]: c["id"] for c in r.json()["checkpoints"]}


def cell_of(driver, count):
    """The timeline's cell whose prompt is In [count]."""
    for c in driver.find_elements(By.CSS_SELECTOR, "#timeline .cell"):
        if c.find_element(By.CSS_SELECTOR, ".prompt").text == f"In [{count}]":
            return c
    return None


def open_live_button(driver, count):
    c = cell_of(driver, count)
    found = c.find_elements(By.CSS_SELECTOR, "button.open-live") if c else []
    return found[0] if found else None


def test_open_live_here_forks_the_step_and_the_list_names_the_parent(broker, browser, tmp_path):
    sid = create_checkpointed(broker)
    for code in ("x = 1", "x = 2", "x = 3"):
        assert execute(broker, sid, code)["status"] == "ok"
    # A failed step takes no checkpoint: it offers nothing.
    assert execute(broker, sid, "raise ValueError('no checkpoint here')")["status"] == "error"
    cps = wait_for(lambda: (lambda c: c if {1, 2, 3} <= set(c) else None)(checkpoints(broker, sid)),
                   what="the checkpoints of steps 1 to 3")
    open_page(browser, broker, sid=sid)
    wait(browser, lambda d: d.find_element(By.ID, "detail").get_attribute("data-loaded") == "true", what="the timeline")
    for n in (1, 2, 3):
        wait(browser, lambda d, n=n: open_live_button(d, n), what=f"open live here on step {n}")
    assert open_live_button(browser, 2).get_attribute("data-checkpoint") == cps[2]
    assert cell_of(browser, 4) is not None and open_live_button(browser, 4) is None, "the failed step offers nothing"
    # A deleted checkpoint is no longer offered.
    assert broker.api("DELETE", f"/v1/sessions/{sid}/checkpoints/{cps[1]}").status_code == 204
    wait(browser, lambda d: open_live_button(d, 1) is None, what="step 1's action gone with its checkpoint")
    shoot(browser, tmp_path, "open-live-here-before")

    before = {r["id"] for r in recordings(broker)}
    # The page's request answers late: the button is disabled meanwhile.
    browser.execute_script("const f = window.fetch; window.fetch = (...a) => String(a[0]).includes('/fork')"
                           " ? new Promise((r) => setTimeout(r, 1000)).then(() => f(...a)) : f(...a);")
    open_live_button(browser, 2).click()
    assert browser.execute_script("return [...document.querySelectorAll('button.open-live')].every((b) => b.disabled)")
    wait(browser, lambda d: d.find_element(By.ID, "detail").get_attribute("data-session") not in (sid, None),
         timeout=60, what="the page showing the new session")
    fork = browser.find_element(By.ID, "detail").get_attribute("data-session")
    assert fork != sid and fork not in before
    assert "forked from" in browser.find_element(By.ID, "status").text
    # The fork holds step 2's state: through the API, and through the page's own session.
    assert execute(broker, fork, "x")["results"][0]["data"]["text/plain"] == "2"
    assert execute(broker, sid, "x")["results"][0]["data"]["text/plain"] == "3", "the original is untouched"
    # The page shows it live, with its actions and its parent in the header.
    wait(browser, lambda d: d.find_element(By.ID, "action-interrupt").is_displayed(), what="the fork's actions")
    assert browser.find_element(By.CSS_SELECTOR, ".session-head .live").is_displayed()
    head = wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".session-head .forked-from"), what="the header's parent")[0]
    assert head.text == f"forked from {sid[:8]} at step 2"
    assert head.find_element(By.CSS_SELECTOR, "a").get_attribute("data-session") == sid
    wait(browser, lambda d: cell_of(d, 3), what="the fork's own cell")
    # The recording links the fork to its parent; the list says so, linking to the parent.
    row = next(r for r in recordings(broker) if r["id"] == fork)
    assert row["forked_from"] == {"session": sid, "execution_count": 2, "checkpoint": cps[2]}, row
    assert next(r for r in recordings(broker) if r["id"] == sid)["forked_from"] is None
    line = wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, f"#session-list li[data-id='{fork}'] .line.fork"),
                timeout=15, what="the fork's line in the list")[0]
    assert line.text == f"forked from {sid[:8]} at step 2"
    shoot(browser, tmp_path, "open-live-here-after")
    # The link opens the parent, whose timeline links to its fork.
    line.find_element(By.CSS_SELECTOR, "a.session-link").click()
    wait(browser, lambda d: d.find_element(By.ID, "detail").get_attribute("data-session") == sid, what="the parent")
    link = wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, f"#timeline .marker[data-kind='session_forked'] a[data-session='{fork}']"),
                what="the parent's link to its fork")[0]
    link.click()
    wait(browser, lambda d: d.find_element(By.ID, "detail").get_attribute("data-session") == fork, what="the fork again")
    for s in (fork, sid):
        assert broker.api("DELETE", f"/v1/sessions/{s}").status_code == 204


def test_open_live_here_refused_is_shown_and_bob_cannot_fork_alices_checkpoint(broker, browser):
    sid = create_checkpointed(broker)
    execute(broker, sid, "secret = 'alice'")
    cp = wait_for(lambda: checkpoints(broker, sid).get(1), what="the checkpoint")
    # Bob, through the API: as missing.
    r = broker.api("POST", f"/v1/sessions/{sid}/checkpoints/{cp}/fork", BOB)
    assert r.status_code == 404, r.text
    assert broker.api("GET", f"/v1/sessions/{sid}/checkpoints", BOB).status_code == 404
    # Bob, through the page: his list has no such session, his page offers nothing and his
    # token's request (the one the page makes) is refused.
    browser.get(f"{broker.url}/ui/?token={BOB}#{sid}")
    wait(browser, lambda d: d.find_element(By.ID, "detail").get_attribute("data-loaded") in ("true", "false"), what="bob's page")
    time.sleep(1.5)
    assert not browser.find_elements(By.CSS_SELECTOR, "button.open-live")
    status = browser.execute_script(
        "return fetch('../v1/sessions/' + arguments[0] + '/checkpoints/' + arguments[1] + '/fork',"
        " {method: 'POST', headers: {Authorization: 'Bearer ' + arguments[2]}}).then((r) => r.status)", sid, cp, BOB)
    assert status == 404
    assert all(r["id"] != sid for r in recordings(broker, BOB))
    # Alice's page: a refusal (the checkpoint gone behind the page's back) is shown as text,
    # the page stays on her session and the button comes back to a usable state.
    browser.execute_script("sessionStorage.clear()")
    open_page(browser, broker, sid=sid)
    wait(browser, lambda d: open_live_button(d, 1), what="open live here")
    broker.api("DELETE", f"/v1/sessions/{sid}/checkpoints/{cp}")
    browser.execute_script("document.querySelector('button.open-live').click()")
    wait(browser, lambda d: "open live here failed" in d.find_element(By.ID, "status").text, what="the refusal")
    assert "error" in browser.find_element(By.ID, "status").get_attribute("class")
    assert browser.find_element(By.ID, "detail").get_attribute("data-session") == sid
    wait(browser, lambda d: open_live_button(d, 1) is None, what="the gone checkpoint's action removed")
    assert execute(broker, sid, "secret")["results"][0]["data"]["text/plain"] == "'alice'", "nothing lost"
    assert broker.api("DELETE", f"/v1/sessions/{sid}").status_code == 204


def test_a_crafted_parent_in_the_list_stays_text(broker, browser):
    sid = create_rest(broker)
    open_page(browser, broker)
    browser.execute_script(STUB)
    now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
    base = {"kernel": "python3", "created_at": now, "ended_at": None, "end_reason": None, "last_event_at": now,
            "cells": 1, "events": 4, "state": "idle", "live": True, "front_door": "rest", "errors": 0,
            "ended_by": None, "metadata": {"evil": HOSTILE}}
    answer = [
        {**base, "id": sid, "forked_from": {"session": HOSTILE, "execution_count": HOSTILE, "checkpoint": HOSTILE}},
        {**base, "id": str(uuid.uuid4()), "forked_from": {"session": ["not", "text"], "execution_count": 1}},
        {**base, "id": str(uuid.uuid4()), "forked_from": HOSTILE},
    ]
    browser.execute_script("window.__answer = arguments[0];", answer)
    browser.find_element(By.ID, "q").send_keys("x\n")
    wait(browser, lambda d: len(listed(d)) == 3, what="the stubbed list")
    a, b, c = browser.find_elements(By.CSS_SELECTOR, "#session-list li.session")
    line = a.find_element(By.CSS_SELECTOR, ".line.fork")
    assert line.get_attribute("textContent").startswith("forked from <img src at step <img src=x")
    link = line.find_element(By.CSS_SELECTOR, "a.session-link")
    assert link.get_attribute("data-session") == HOSTILE and link.text == HOSTILE[:8]
    assert not line.find_elements(By.CSS_SELECTOR, "img")
    assert not b.find_elements(By.CSS_SELECTOR, ".line.fork") and not c.find_elements(By.CSS_SELECTOR, ".line.fork")
    assert not browser.find_elements(By.CSS_SELECTOR, "#sessions img")
    assert browser.execute_script("return window.__pwned") is None


# ---- layout ----------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [(1280, 900), (1920, 1080)])
def test_the_layout_holds_at_common_widths(broker, browser, tmp_path, size):
    w, h = size
    browser.set_window_size(w, h)
    sid = create_rest(broker, {"agent": "layout " + LONG[:1000], "evil": HOSTILE})
    tag = uuid.uuid4().hex[:8]
    execute(broker, sid, f"print('layout-{tag} ' + 'L' * 400)\n" + "1/0")
    # With a search active, so that the entry has its snippets.
    open_page(browser, broker, f"q=layout-{tag}", sid=sid)
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, f"#session-list li[data-id='{sid}']"), what="the entry")
    wait(browser, lambda d: d.find_element(By.ID, "detail").get_attribute("data-loaded") == "true", what="the timeline")
    browser.find_element(By.TAG_NAME, "body").send_keys("j")
    wait(browser, lambda d: "cell 1 of 1" in d.find_element(By.CSS_SELECTOR, ".toolbar .position").text, what="the position")
    # The JupyterLab link as it appears after "Open in JupyterLab".
    browser.execute_script("const a = document.getElementById('jupyterlab-link'); a.href = 'http://127.0.0.1:8888/lab/tree/x.ipynb'; a.hidden = false;"
                           "document.getElementById('jupyterlab-url').value = 'http://127.0.0.1:8888/lab?token=' + 'a'.repeat(48);")

    # The state pills: one line each, in the list and in the header.
    for pill in browser.find_elements(By.CSS_SELECTOR, "#session-list .state, .session-head .state"):
        n = browser.execute_script("return arguments[0].getClientRects().length", pill)
        r = rect(browser, pill)
        assert n == 1 and r["h"] < 24, f"a state pill on more than one line: {r}"
    # The toolbar's buttons and link share one row, inside the toolbar.
    bar = browser.find_element(By.CSS_SELECTOR, ".toolbar")
    items = [e for e in bar.find_elements(By.CSS_SELECTOR, ":scope > *") if e.is_displayed()]
    assert browser.find_element(By.ID, "jupyterlab-link") in items
    tops = {round(rect(browser, e)["t"] + rect(browser, e)["h"] / 2) for e in items}
    assert max(tops) - min(tops) <= 3, f"the toolbar wraps: {tops}"
    bar_r = rect(browser, bar)
    for e in items:
        assert rect(browser, e)["r"] <= bar_r["r"] + 1, f"{e.tag_name} sticks out of the toolbar"
    no_overlaps(browser, items, "toolbar")
    # The session head: title and actions, and the facts.
    no_overlaps(browser, browser.find_elements(By.CSS_SELECTOR, ".session-head .title-row > *"), "title row")
    no_overlaps(browser, browser.find_elements(By.CSS_SELECTOR, ".session-head .facts > *"), "facts")
    # Each list entry: its lines and the parts of each line.
    for li in browser.find_elements(By.CSS_SELECTOR, "#session-list li.session")[:10]:
        no_overlaps(browser, li.find_elements(By.CSS_SELECTOR, ":scope > *"), "list entry")
        for line in li.find_elements(By.CSS_SELECTOR, ":scope > .line"):
            no_overlaps(browser, line.find_elements(By.CSS_SELECTOR, ":scope > *"), "list entry line")
    # The search form's fields.
    no_overlaps(browser, browser.find_elements(By.CSS_SELECTOR, "#search .filters > *, #search .date"), "filters")
    assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth"), "the page scrolls sideways"
    shoot(browser, tmp_path, f"layout-{w}x{h}")


@needs_criu
def test_pause_and_resume_from_the_page(broker, browser, tmp_path):
    """Issue 37 in the session browser: a running session offers Pause; paused, it is shown
    `paused` with a Resume button and the pause in its timeline; Resume brings its variables
    back."""
    r = broker.api("POST", "/v1/sessions", json={"workspace": "own"})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    try:
        execute(broker, sid, "kept = 42")
        open_page(browser, broker, sid=sid)
        wait(browser, lambda d: d.find_element(By.ID, "action-pause").is_displayed(), what="Pause")
        assert not browser.find_element(By.ID, "action-resume").is_displayed()
        browser.find_element(By.ID, "action-pause").click()
        wait(browser, lambda d: "paused to disk" in d.find_element(By.ID, "status").text, timeout=60, what="paused")
        assert broker.api("GET", f"/v1/sessions/{sid}").json()["state"] == "paused"
        wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, ".session-head .state").text == "paused",
             timeout=15, what="the paused state")
        wait(browser, lambda d: d.find_element(By.ID, "action-resume").is_displayed(), what="Resume")
        assert not browser.find_element(By.ID, "action-pause").is_displayed()
        wait(browser, lambda d: marker(d, "session_paused"), timeout=15, what="the pause in the timeline")
        shoot(browser, tmp_path, "paused")
        browser.find_element(By.ID, "action-resume").click()
        wait(browser, lambda d: "resumed" in d.find_element(By.ID, "status").text, timeout=60, what="resumed")
        wait(browser, lambda d: d.find_element(By.ID, "action-pause").is_displayed(), timeout=15, what="Pause again")
        assert execute(broker, sid, "kept")["results"][0]["data"]["text/plain"] == "42"
        wait(browser, lambda d: marker(d, "session_resumed"), timeout=15, what="the resume in the timeline")
    finally:
        broker.api("DELETE", f"/v1/sessions/{sid}")


def snapshot_items(driver):
    return driver.find_elements(By.CSS_SELECTOR, "#snapshots li[data-snapshot]")


@needs_criu
def test_snapshots_from_the_page(broker, browser, tmp_path):
    """Issue 37 in the session browser: Snapshot takes a named snapshot of the open session,
    which the page lists under it; `start` opens a new session with the snapshot's state;
    `delete` removes it. A refusal is shown as text; bob sees and starts none of alice's."""
    r = broker.api("POST", "/v1/sessions", json={"workspace": "own"})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    made = []
    try:
        execute(broker, sid, "kept = 7")
        open_page(browser, broker, sid=sid)
        wait(browser, lambda d: d.find_element(By.ID, "action-snapshot").is_displayed(), what="Snapshot")
        assert not browser.find_element(By.ID, "snapshots").is_displayed(), "none yet: no panel"
        # A bad name: the broker's refusal is shown, nothing is made.
        browser.execute_script("window.prompt = () => 'a name with spaces';")
        browser.find_element(By.ID, "action-snapshot").click()
        wait(browser, lambda d: "snapshot failed" in d.find_element(By.ID, "status").text, timeout=30, what="the refusal")
        assert "error" in browser.find_element(By.ID, "status").get_attribute("class")
        assert broker.api("GET", "/v1/snapshots").json() == []
        # Cancelled: nothing asked of the broker.
        browser.execute_script("window.prompt = () => null;")
        browser.find_element(By.ID, "action-snapshot").click()
        assert broker.api("GET", "/v1/snapshots").json() == []
        # Taken, named.
        browser.execute_script("window.prompt = () => 'after-load';")
        browser.find_element(By.ID, "action-snapshot").click()
        wait(browser, lambda d: "taken" in d.find_element(By.ID, "status").text, timeout=60, what="the snapshot")
        snaps = broker.api("GET", "/v1/snapshots").json()
        assert [(s["name"], s["session_id"]) for s in snaps] == [("after-load", sid)], snaps
        snap = snaps[0]["snapshot_id"]
        items = wait(browser, snapshot_items, timeout=15, what="the snapshot listed")
        assert items[0].get_attribute("data-snapshot") == snap
        assert items[0].find_element(By.CSS_SELECTOR, ".name").text == "after-load"
        shoot(browser, tmp_path, "snapshots")
        # The session runs on, changed after it.
        execute(broker, sid, "kept = 8")
        # Bob: the list the page asks for has none of alice's; his token cannot start from it.
        assert broker.api("GET", "/v1/snapshots", BOB).json() == []
        r = broker.api("POST", "/v1/sessions", BOB, json={"snapshot": snap})
        assert r.status_code == 404, r.text
        # Started from it: the page opens the new session, which holds the snapshot's state.
        items[0].find_element(By.CSS_SELECTOR, "button.start-snapshot").click()
        wait(browser, lambda d: d.find_element(By.ID, "detail").get_attribute("data-session") not in (sid, None),
             timeout=60, what="the page showing the new session")
        new = browser.find_element(By.ID, "detail").get_attribute("data-session")
        made.append(new)
        assert "started from snapshot after-load" in browser.find_element(By.ID, "status").text
        assert execute(broker, new, "kept")["results"][0]["data"]["text/plain"] == "7"
        assert execute(broker, sid, "kept")["results"][0]["data"]["text/plain"] == "8", "the original is its own"
        # Back on the original: delete it (confirmed), and it is gone from the page and the broker.
        open_page(browser, broker, sid=sid)
        items = wait(browser, snapshot_items, timeout=15, what="the snapshot listed again")
        browser.execute_script("window.confirm = () => true;")
        items[0].find_element(By.CSS_SELECTOR, "button.delete-snapshot").click()
        wait(browser, lambda d: "deleted" in d.find_element(By.ID, "status").text, timeout=30, what="deleted")
        wait(browser, lambda d: not snapshot_items(d), timeout=15, what="the snapshot gone from the page")
        assert broker.api("GET", "/v1/snapshots").json() == []
        assert execute(broker, new, "kept")["results"][0]["data"]["text/plain"] == "7", "its sessions go on"
    finally:
        for s in made + [sid]:
            broker.api("DELETE", f"/v1/sessions/{s}")
        for s in broker.api("GET", "/v1/snapshots").json():
            broker.api("DELETE", f"/v1/snapshots/{s['snapshot_id']}")
