"""The session browser at /ui/ in headless Chromium: it asks for a token, lists sessions,
shows a session's cells with streams, errors and a chart, and follows a live execution."""
import os
import shutil
import threading
import time

import pytest
import requests
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from conftest import ALICE

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


@pytest.fixture
def browser(tmp_path):
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip("chromium and chromium-driver are needed (scripts/setup --test installs them)")
    os.environ.setdefault("SE_OFFLINE", "true")  # never let Selenium Manager download anything
    opts = Options()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-dev-shm-usage", "--window-size=1280,1000",
                 f"--user-data-dir={tmp_path / 'chromium'}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def create(b):
    r = b.api("POST", "/v1/sessions", json={})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def execute(b, sid, code):
    r = b.api("POST", f"/v1/sessions/{sid}/execute", json={"code": code}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def wait(driver, pred, timeout=20, what="the page"):
    # The page replaces a cell's element when the cell changes: look elements up afresh.
    return WebDriverWait(driver, timeout, poll_frequency=0.1,
                         ignored_exceptions=(StaleElementReferenceException,)).until(
        lambda d: pred(d), message=what)


def cells(driver):
    return driver.find_elements(By.CSS_SELECTOR, "#timeline .cell")


def test_ui_shows_a_session_and_follows_it_live(broker, browser, tmp_path):
    sid = create(broker)
    execute(broker, sid, "print('hello from the agent')")
    execute(broker, sid, "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()")
    execute(broker, sid, "1/0")

    # Without a token: the sign-in form, nothing else.
    browser.get(f"{broker.url}/ui/")
    wait(browser, lambda d: d.find_elements(By.NAME, "token"), what="the token form")
    assert not browser.find_elements(By.ID, "session-list")

    browser.get(f"{broker.url}/ui/?token={ALICE}#{sid}")
    wait(browser, lambda d: len(cells(d)) >= 3, what="three cells")
    assert "token=" not in browser.current_url, "the token stays out of the address bar"
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, f"#session-list li[data-id='{sid}']"),
         what="the session in the list")
    # Its memory use and limit, in the list and the header (a live session).
    wait(browser, lambda d: " MiB of 256 MiB memory" in d.find_element(
        By.CSS_SELECTOR, f"#session-list li[data-id='{sid}'] .mem").text, what="the memory in the list")
    wait(browser, lambda d: " MiB of 256 MiB memory" in d.find_element(
        By.CSS_SELECTOR, ".session-head .mem").text, what="the memory in the header")

    first, chart, error = cells(browser)[:3]
    assert "print('hello from the agent')" in first.find_element(By.CSS_SELECTOR, ".code").text
    assert first.find_element(By.CSS_SELECTOR, ".stream.stdout").text == "hello from the agent"
    assert first.get_attribute("data-status") == "ok"
    assert "ms" in first.find_element(By.CSS_SELECTOR, ".duration").text
    img = chart.find_element(By.CSS_SELECTOR, "img.output-image")
    assert img.get_attribute("src").startswith("data:image/png;base64,iVBOR")
    wait(browser, lambda d: d.execute_script("return arguments[0].complete && arguments[0].naturalWidth", img) > 100,
         what="the chart to render")
    assert "ZeroDivisionError" in error.find_element(By.CSS_SELECTOR, ".error .ename").text
    assert error.get_attribute("data-status") == "error"

    # A reload (the token is only in sessionStorage now) still gets the page.
    browser.refresh()
    wait(browser, lambda d: len(cells(d)) >= 3, what="cells after a reload")

    # Live: a slow cell started over REST shows up, and its output arrives while it runs.
    code = "import time\nfor i in range(8):\n    print('tick', i, flush=True)\n    time.sleep(1)"
    result = {}
    runner = threading.Thread(target=lambda: result.update(execute(broker, sid, code)))
    runner.start()
    try:
        wait(browser, lambda d: len(cells(d)) >= 4, what="the live cell")
        wait(browser, lambda d: "tick 2" in cells(d)[3].text, timeout=30, what="live output")
        assert runner.is_alive(), "the output should appear while the cell still runs"
        assert wait(browser, lambda d: "running" in cells(d)[3].get_attribute("class"))
        browser.save_screenshot(str(tmp_path / "ui-live.png"))
    finally:
        runner.join(60)
    assert result["status"] == "ok"
    wait(browser, lambda d: cells(d)[3].get_attribute("data-status") == "ok"
         and "tick 7" in cells(d)[3].text, timeout=30, what="the finished cell")

    # Stepping through cells with the keyboard.
    browser.find_element(By.TAG_NAME, "body").send_keys("j")
    wait(browser, lambda d: "current" in cells(d)[0].get_attribute("class"), what="cell 1 selected")
    browser.find_element(By.TAG_NAME, "body").send_keys("j")
    wait(browser, lambda d: "current" in cells(d)[1].get_attribute("class"), what="cell 2 selected")

    # The session ends: the page shows it.
    assert broker.api("DELETE", f"/v1/sessions/{sid}").status_code == 204
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".marker-session_closed"), timeout=15,
         what="the session_closed marker")


def test_ui_replays_a_session_and_shows_the_differences(broker, browser):
    sid = create(broker)
    execute(broker, sid, "import random")
    execute(broker, sid, "random.random()")
    browser.get(f"{broker.url}/ui/?token={ALICE}#{sid}")
    wait(browser, lambda d: len(cells(d)) == 2, what="two cells")
    browser.find_element(By.XPATH, "//button[contains(., 'Replay')]").click()
    wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".badge.replay")) == 2, timeout=60,
         what="replay badges")
    same, different = cells(browser)
    assert "same" in same.find_element(By.CSS_SELECTOR, ".badge.replay").get_attribute("class")
    assert "different" in different.find_element(By.CSS_SELECTOR, ".badge.replay").get_attribute("class")
    diff = different.find_element(By.CSS_SELECTOR, "details.diff pre")
    assert "--- recorded" in diff.get_attribute("textContent")
    assert "1 of 2 cells gave the same output" in browser.find_element(By.ID, "status").text
