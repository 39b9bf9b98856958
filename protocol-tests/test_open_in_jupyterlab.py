"""An agent's session opened in a real JupyterLab 4 (`jupyter lab --gateway-url=<broker>`), in
headless Chromium, in one step: the session browser's "Open in JupyterLab" button (and
scripts/open-in-jupyterlab, its command-line twin) attach the session's kernel to a notebook
of the Jupyter server; in JupyterLab the person runs code that reads the agent's variables.

Why a button and not JupyterLab's kernel picker: jupyter_server's gateway client
(GatewayMappingKernelManager.list_kernels) lists only the gateway kernels that Jupyter server
itself started or attached, so a kernel the agent started is never offered there until a
Jupyter session names it (POST /api/sessions {"kernel": {"id"}}): that is what the button does.

Stopping JupyterLab afterwards shuts down the kernels it knows; the agent's session is not
JupyterLab's to end (its front door made it), so the broker only detaches Jupyter from it.
"""
import subprocess
import sys

import pytest
import requests
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from conftest import ALICE, REPO

AUTH = {"Authorization": f"Bearer {ALICE}"}
from test_gateway import VENV_BIN, JupyterServer
from test_ui import browser, create, execute, wait  # noqa: F401  (browser is a fixture)


@pytest.fixture
def lab(broker):
    if not (VENV_BIN / "jupyter-lab").exists():
        pytest.skip("jupyterlab is not installed in protocol-tests/.venv (scripts/setup --test)")
    js = JupyterServer(broker.url, ALICE, app="lab",
                       extra_args=[f"--ServerApp.allow_origin={broker.url}"])
    yield js
    js.stop()


def lab_sessions(lab):
    r = lab.api("GET", "/api/sessions")
    assert r.status_code == 200, r.text
    return {s["kernel"]["id"]: s for s in r.json()}


def run_in_jupyterlab(driver, code, expect, timeout=90):
    """Types `code` into the notebook's last cell (in place of what it held), runs it with
    Shift+Enter, and waits for `expect` in an output."""
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, ".jp-NotebookPanel .jp-Cell"),
         timeout=timeout, what="the notebook's cells in JupyterLab")
    wait(driver, lambda d: d.find_elements(
        By.CSS_SELECTOR, ".jp-Notebook-ExecutionIndicator[data-status='idle']"),
        timeout=timeout, what="JupyterLab connected to the agent's kernel (idle)")

    def last_editor(d):
        # JupyterLab renders cells lazily: bring the last one into view until its editor shows.
        cells = d.find_elements(By.CSS_SELECTOR, ".jp-NotebookPanel .jp-Cell")
        if not cells:
            return None
        d.execute_script("arguments[0].scrollIntoView({block: 'center'})", cells[-1])
        editors = [e for e in cells[-1].find_elements(By.CSS_SELECTOR, ".cm-content")
                   if e.is_displayed() and e.size["height"] > 0]
        return editors[0] if editors else None

    editor = wait(driver, last_editor, timeout=timeout, what="the last cell's editor")
    ActionChains(driver).move_to_element(editor).click().perform()
    ActionChains(driver).key_down(Keys.CONTROL).send_keys("a").key_up(Keys.CONTROL) \
        .send_keys(Keys.DELETE).send_keys(code) \
        .key_down(Keys.SHIFT).send_keys(Keys.ENTER).key_up(Keys.SHIFT).perform()
    wait(driver, lambda d: any(expect in o.text for o in d.find_elements(
        By.CSS_SELECTOR, ".jp-NotebookPanel .jp-OutputArea-output")),
        timeout=timeout, what=f"{expect!r} in an output")


@pytest.mark.timeout(600)
def test_open_in_jupyterlab_from_the_session_browser(broker, lab, browser):
    sid = create(broker)
    assert execute(broker, sid, "agent_total = 1234\nprint('agent ran')")["status"] == "ok"
    # Before: JupyterLab's kernel list does not offer the agent's kernel (see the module doc).
    assert sid not in {k["id"] for k in lab.api("GET", "/api/kernels").json()}

    browser.get(f"{broker.url}/ui/?token={ALICE}#{sid}")
    field = wait(browser, lambda d: d.find_elements(By.ID, "jupyterlab-url"), what="the field")[0]
    field.send_keys(f"{lab.url}/lab?token={lab.token}")
    browser.find_element(By.ID, "open-in-jupyterlab").click()
    link = wait(browser, lambda d: [a for a in d.find_elements(By.ID, "jupyterlab-link")
                                    if a.is_displayed()],
                timeout=60, what="the JupyterLab link (attach done)")[0]
    url = link.get_attribute("href")
    assert url.startswith(f"{lab.url}/lab/tree/agent-session-{sid[:8]}.ipynb"), url
    # The Jupyter server now has a session on the agent's kernel, and lists the kernel.
    assert lab_sessions(lab)[sid]["path"] == f"agent-session-{sid[:8]}.ipynb"
    assert sid in {k["id"] for k in lab.api("GET", "/api/kernels").json()}

    # The person opens it and reads the agent's variable from JupyterLab itself.
    for handle in browser.window_handles[1:]:  # the tab the button opened, if any
        browser.switch_to.window(handle)
        browser.close()
    browser.switch_to.window(browser.window_handles[0])
    browser.get(url)
    run_in_jupyterlab(browser, "print('from lab', agent_total * 2)", "from lab 2468")
    # ...and the agent sees what the person did, in the same kernel.
    x = execute(broker, sid, "agent_total + 1")
    assert x["results"][0]["data"]["text/plain"] == "1235", x

    # The person stops JupyterLab (SIGTERM): it shuts down the kernels it knows, the agent's
    # among them. The session is the agent's (its front door made it): Jupyter only lets go.
    lab.stop()
    assert lab.proc.returncode is not None
    info = requests.get(f"{broker.url}/v1/sessions/{sid}", headers=AUTH, timeout=30)
    assert info.status_code == 200 and info.json()["state"] == "idle", info.text
    x = execute(broker, sid, "print(agent_total + 2)")
    assert x["stdout"] == "1236\n", x
    events = requests.get(f"{broker.url}/v1/sessions/{sid}/events?channel=broker",
                          headers=AUTH, timeout=30).json()["events"]
    kinds = [e["kind"] for e in events]
    assert "session_detached" in kinds, f"JupyterLab's shutdown reached the broker: {kinds}"
    assert all(e["detail"] == {"by": "jupyter"} for e in events
               if e["kind"] == "session_detached"), events
    assert "session_closed" not in kinds, kinds


def test_open_in_jupyterlab_from_the_command_line(broker, lab):
    sid = create(broker)
    execute(broker, sid, "agent_rows = 7")
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts/open-in-jupyterlab"), sid,
         "--broker", broker.url, "--token", ALICE, "--jupyter", f"{lab.url}/lab?token={lab.token}"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{lab.url}/lab/tree/agent-session-{sid[:8]}.ipynb?token={lab.token}"
    session = lab_sessions(lab)[sid]
    # The notebook holds the agent's cells so far; its kernel is the agent's.
    nb = lab.api("GET", f"/api/contents/{session['path']}").json()["content"]
    assert any("agent_rows = 7" in "".join(c["source"]) for c in nb["cells"]), nb
    # Code sent through the Jupyter server reaches the agent's kernel and its variables.
    ws = lab.ws(sid)
    try:
        run = ws.run("agent_rows * 6")
        assert run.result == "42", run.msgs
    finally:
        ws.close()


@pytest.mark.timeout(600)
def test_open_live_here_then_open_in_jupyterlab_attaches_to_the_fork(broker, lab, browser):
    """Time travel end to end: "open live here" on step 2 of a checkpointed session opens the
    fork in the session browser, and "Open in JupyterLab" attaches JupyterLab to the fork's
    kernel, which holds step 2's variables (the original keeps step 3's)."""
    r = requests.post(f"{broker.url}/v1/sessions", headers=AUTH, timeout=60,
                      json={"checkpoint_every_execution": True})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    for code in ("step = 1", "step = 2", "step = 3"):
        assert execute(broker, sid, code)["status"] == "ok"
    browser.get(f"{broker.url}/ui/?token={ALICE}#{sid}")

    def step_2_button(d):
        for c in d.find_elements(By.CSS_SELECTOR, "#timeline .cell"):
            if c.find_element(By.CSS_SELECTOR, ".prompt").text == "In [2]":
                return (c.find_elements(By.CSS_SELECTOR, "button.open-live") or [None])[0]
        return None

    wait(browser, step_2_button, timeout=30, what="open live here on step 2").click()
    wait(browser, lambda d: d.find_element(By.ID, "detail").get_attribute("data-session") not in (sid, None),
         timeout=60, what="the fork opened")
    fork = browser.find_element(By.ID, "detail").get_attribute("data-session")
    field = browser.find_element(By.ID, "jupyterlab-url")
    field.clear()
    field.send_keys(f"{lab.url}/lab?token={lab.token}")
    browser.find_element(By.ID, "open-in-jupyterlab").click()
    link = wait(browser, lambda d: [a for a in d.find_elements(By.ID, "jupyterlab-link") if a.is_displayed()],
                timeout=60, what="the JupyterLab link (attach done)")[0]
    url = link.get_attribute("href")
    assert url.startswith(f"{lab.url}/lab/tree/agent-session-{fork[:8]}.ipynb"), url
    assert lab_sessions(lab)[fork]["path"] == f"agent-session-{fork[:8]}.ipynb"
    for handle in browser.window_handles[1:]:
        browser.switch_to.window(handle)
        browser.close()
    browser.switch_to.window(browser.window_handles[0])
    browser.get(url)
    run_in_jupyterlab(browser, "print('lab sees step', step)", "lab sees step 2")
    assert execute(broker, sid, "step")["results"][0]["data"]["text/plain"] == "3"
    lab.stop()
    for s in (fork, sid):
        requests.delete(f"{broker.url}/v1/sessions/{s}", headers=AUTH, timeout=60)


@pytest.mark.timeout(600)
def test_jupyterlabs_launcher_offers_every_language_and_runs_one(broker, lab, browser):
    # JupyterLab through the broker (--gateway-url): its launcher lists the broker's kernel
    # specs (issue 38), and a notebook of another language runs in a broker session.
    browser.get(f"{lab.url}/lab?token={lab.token}")
    want = {"Python 3 (ipykernel)", "R", "JavaScript and TypeScript (Deno)", "Bash",
            "Java (jjava)", "SQL (DuckDB)"}

    def cards(d):
        labels = {c.get_attribute("title") or c.text for c in d.find_elements(
            By.CSS_SELECTOR, ".jp-Launcher-section .jp-LauncherCard")}
        labels = {label.strip() for label in labels}
        return labels if want <= {label for label in labels if label} else None

    wait(browser, cards, timeout=120, what="the launcher's cards for every language")
    card = [c for c in browser.find_elements(By.CSS_SELECTOR, ".jp-LauncherCard")
            if (c.get_attribute("title") or c.text).strip() == "R"][0]
    before = {s["id"] for s in requests.get(f"{broker.url}/v1/sessions", headers=AUTH, timeout=30).json()}
    card.click()
    # The new notebook's kernel is started through the broker: code typed before JupyterLab
    # says the kernel is idle would not run.
    wait(browser, lambda d: any("R | Idle" in e.text for e in d.find_elements(
        By.CSS_SELECTOR, ".jp-StatusBar-Item")), timeout=120, what="JupyterLab's R kernel idle")
    try:
        run_in_jupyterlab(browser, "cat(sprintf('from R %d', 6L * 7L))", "from R 42")
    except Exception:
        browser.save_screenshot("/tmp/lt/lab.png")
        raise
    made = [s for s in requests.get(f"{broker.url}/v1/sessions", headers=AUTH, timeout=30).json()
            if s["id"] not in before]
    assert [s["kernel"] for s in made] == ["r"], made
