"""The console in a real browser: Debian's headless Chromium, driven by Selenium through the
system's chromedriver, against ``saga serve`` started as a subprocess on the package's private
deployment. Chromium missing: skipped here, a failure in CI (``.ci/run`` installs it).

Screenshots of the run and escalation pages go to ``test-artefacts/`` (``SAGA_TEST_ARTEFACTS``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from saga import RunState
from saga.web import tokens
from tasks import systems
from tests.conftest import service_missing
from tests.integration.web.conftest import ARTEFACTS, Web

pytestmark = pytest.mark.timeout(180)

CHROMIUM = os.environ.get("SAGA_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("SAGA_TEST_CHROMEDRIVER", "/usr/bin/chromedriver")
#: Seconds a page may take to show what a test waits for.
WAIT = 60


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium with a fresh profile, quit at the end."""
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        service_missing(
            f"Chromium and its driver ({CHROMIUM}, {CHROMEDRIVER}) are needed for the console's "
            "browser tests: apt-get install chromium chromium-driver"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="saga-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1280,1500",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # CSP reports land there
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(WAIT)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def log_in(browser: Any, server: str, token: str) -> None:
    from selenium.webdriver.common.by import By

    browser.delete_all_cookies()
    browser.get(server + "/console/login")
    browser.find_element(By.NAME, "token").send_keys(token)
    browser.find_element(By.CSS_SELECTOR, "form button").click()
    until(browser, lambda: browser.current_url.endswith("/console/runs"), "the runs page")


def until(browser: Any, condition: Any, what: str) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, WAIT, poll_frequency=0.2).until(
        lambda _: condition(), message=f"waiting for {what}"
    )


def replaced(exc: Exception) -> bool:
    """Whether ``exc`` says a live update swapped the element out between finding and using
    it (chromedriver reports that either as a stale element or, when the swap lands inside the
    call, as an inspector error naming a node no longer in the document): try again."""
    from selenium.common.exceptions import (
        NoSuchElementException,
        StaleElementReferenceException,
        WebDriverException,
    )

    if isinstance(exc, (NoSuchElementException, StaleElementReferenceException)):
        return True
    return isinstance(exc, WebDriverException) and "does not belong to the document" in str(exc)


def text_of(browser: Any, css: str) -> str:
    from selenium.webdriver.common.by import By

    try:
        return str(browser.find_element(By.CSS_SELECTOR, css).text)
    except Exception as exc:
        if replaced(exc):
            return ""
        raise


def shot(browser: Any, name: str) -> None:
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.set_window_size(1280, max(900, min(int(height) + 40, 2600)))
    browser.save_screenshot(str(ARTEFACTS / name))
    browser.set_window_size(1280, 1500)


def test_requeue_an_escalated_run_and_watch_it_compensate(
    web: Web, server: str, browser: Any, fresh_world: None
) -> None:
    """Log in; the escalated run shows its failed compensation; its escalation page offers
    the requeue; once billing is back, the requeue (reviewed, then confirmed) lands on the
    run page, which turns compensated by itself, without a reload."""
    from selenium.webdriver.common.by import By

    run_id = web.escalated_run()
    log_in(browser, server, web.operate_token)
    # The run: escalated, the reversal's undo failed (✗) after its attempts
    browser.get(f"{server}/console/runs/{run_id}")
    assert text_of(browser, "#run-state") == "escalated"
    failed = text_of(browser, "#unwind tr.comp-failed")
    assert "reverse_credit" in failed and "✗" in failed
    assert "PIVOT" not in text_of(browser, "#timeline") and "UNWIND" in text_of(
        browser, "#timeline"
    )
    shot(browser, "run-escalated.png")
    # Its escalation: why, the failed undo with its errors, the requeue form
    browser.find_element(By.PARTIAL_LINK_TEXT, "escalation").click()
    until(browser, lambda: "/console/escalations/" in browser.current_url, "the escalation")
    assert "compensation failed" in browser.page_source
    shot(browser, "escalation.png")
    # When billing is back (slowly, so the unwind is seen) and the requeue is confirmed
    systems.set_down("reversal", False)
    systems.set_delay("reversal", 1.5)
    browser.find_element(By.CSS_SELECTOR, "#requeue-form button").click()
    until(browser, lambda: "No argument changes" in browser.page_source, "the requeue's review")
    browser.find_element(By.NAME, "confirm").click()
    until(browser, lambda: browser.current_url.endswith(f"/console/runs/{run_id}"), "the run")
    browser.execute_script("window.sagaTestMark = 'same page';")
    # Then the page turns compensated by itself
    until(browser, lambda: text_of(browser, "#run-state") == "compensated", "compensated")
    assert browser.execute_script("return window.sagaTestMark") == "same page"
    assert "✓" in text_of(browser, "#unwind")
    web.recorded(run_id, RunState.COMPENSATED)


def test_approve_a_pending_call_and_see_it_run(
    web: Web, server: str, browser: Any, fresh_world: None
) -> None:
    """A hosted run waits for a person before its reply: the run page shows the call, its
    arguments and hash; Approve sends it and the page shows the run complete."""

    started = web.client(web.operate_token).post(
        "/api/runs", json={"agent": "approver", "input": "please reply"}
    )
    run_id = started.json()["run_id"]
    log_in(browser, server, web.operate_token)
    browser.get(f"{server}/console/approvals")
    until(browser, lambda: run_id in browser.page_source or _reload(browser), "the call listed")
    browser.get(f"{server}/console/runs/{run_id}")
    until(browser, lambda: "send_reply" in text_of(browser, ".approval"), "the call to approve")
    shot(browser, "run-approval.png")
    call_hash = until(browser, lambda: text_of(browser, ".approval .hash"), "the call's hash")
    assert len(call_hash) == 64
    until(browser, lambda: _click(browser, ".approval button[name=approve]"), "approve")
    until(browser, lambda: text_of(browser, "#run-state") == "completed", "the run completed")
    assert "Sent." in text_of(browser, ".transcript")
    assert len(systems.outbox()) == 1


def test_a_read_login_sees_no_buttons_and_a_forged_post_changes_nothing(
    web: Web, server: str, browser: Any, fresh_world: None
) -> None:
    """bob (read) sees the run and the escalation without a single action; a form posted
    without the CSRF token (by alice's session) or by bob is refused, and the run goes on."""
    from selenium.webdriver.common.by import By

    escalated = web.escalated_run()
    running = web.saga.start_run()
    log_in(browser, server, web.read_token)
    for page in (f"/console/runs/{running.run_id}", f"/console/escalations/{escalated}:0"):
        browser.get(server + page)
        actions = [
            f.get_attribute("action")
            for f in browser.find_elements(By.CSS_SELECTOR, "form[method=post]")
        ]
        assert [a for a in actions if not a.endswith("/console/logout")] == [], page
    # bob posting an abort, CSRF token and all: refused
    _post(browser, f"/console/runs/{running.run_id}/abort", with_csrf=True)
    assert "may only read" in browser.page_source
    # alice's session, a form without the CSRF token: refused
    log_in(browser, server, web.operate_token)
    browser.get(f"{server}/console/runs/{running.run_id}")
    assert browser.find_elements(By.CSS_SELECTOR, "form[action$='/abort']")
    _post(browser, f"/console/runs/{running.run_id}/abort", with_csrf=False)
    assert "CSRF" in browser.page_source
    assert web.saga.store.head(running.run_id).state is RunState.RUNNING  # type: ignore[union-attr]
    running.abort("test over")


def test_pages_carry_security_headers_and_the_policy_holds_in_chromium(
    web: Web, server: str, browser: Any
) -> None:
    """The run page as Chromium gets it: not stored, framed by nobody, its
    Content-Security-Policy in force (an injected inline script does not run) and the page's
    own script and style not refused by it; after logout the back button shows no run."""
    from selenium.webdriver.common.by import By

    run = web.saga.start_run()
    name, text = _own_token(web)
    log_in(browser, server, text)
    page = f"{server}/console/runs/{run.run_id}"
    browser.get(page)
    until(browser, lambda: text_of(browser, "#run-state") == "running", "the run page")
    headers = browser.execute_async_script(
        """
        const done = arguments[arguments.length - 1];
        fetch(location.href).then(r => done(Object.fromEntries(r.headers.entries())));
        """
    )
    assert headers["cache-control"] == "no-store"
    assert headers["x-frame-options"] == "DENY" and headers["x-content-type-options"] == "nosniff"
    assert headers["referrer-policy"] == "no-referrer"
    assert "frame-ancestors 'none'" in headers["content-security-policy"]
    assert browser.execute_script("return document.querySelector('[data-live]') !== null")
    injected = browser.execute_script(
        """
        const s = document.createElement('script');
        s.textContent = 'window.sagaInjected = true;';
        document.body.appendChild(s);
        return window.sagaInjected === true;
        """
    )
    assert injected is False
    refused = [
        e["message"] for e in browser.get_log("browser") if "Content Security" in e["message"]
    ]
    assert len(refused) == 1 and "inline" in refused[0], refused  # the injected one only
    # After logout, back: the server answers again (no stored page), with the login form
    browser.find_element(By.CSS_SELECTOR, "form.who button").click()
    until(browser, lambda: "/console/login" in browser.current_url, "the login form")
    browser.back()
    until(browser, lambda: "/console/login" in browser.current_url, "the login form again")
    assert run.run_id not in text_of(browser, "main")
    tokens.revoke(web.saga.records, name)
    run.abort("test over")


def test_an_open_live_stream_ends_on_logout_elsewhere_and_on_revoke(
    web: Web, server: str, browser: Any
) -> None:
    """A run page watching its run live: logging out in another tab ends its stream at once
    (the live mark goes, the run's next state never arrives); so does revoking the token."""
    from selenium.webdriver.common.by import By

    for how in ("logout", "revoke"):
        run = web.saga.start_run()
        name, text = _own_token(web)
        log_in(browser, server, text)
        browser.get(f"{server}/console/runs/{run.run_id}")
        until(browser, lambda: browser.find_elements(By.CSS_SELECTOR, ".live-dot"), "live")
        watching = browser.current_window_handle
        if how == "logout":
            browser.switch_to.new_window("tab")
            browser.get(f"{server}/console/runs")
            browser.find_element(By.CSS_SELECTOR, "form.who button").click()
            until(browser, lambda: "/console/login" in browser.current_url, "logged out")
            browser.close()
            browser.switch_to.window(watching)
        else:
            tokens.revoke(web.saga.records, name)
        until(browser, lambda: browser.find_element(By.ID, "run").get_attribute("data-ended"), how)
        assert not browser.find_elements(By.CSS_SELECTOR, ".live-dot"), how
        run.abort(f"after the {how}")
        web.recorded(run.run_id, RunState.COMPENSATED)
        # The stream closed before the run moved: the page still shows it running
        assert text_of(browser, "#run-state") == "running", how
        if how == "logout":
            tokens.revoke(web.saga.records, name)


def _own_token(web: Web) -> tuple[str, str]:
    """A ``read`` token of the test's own (one it may revoke): its name and text."""
    name = f"b-{uuid.uuid4().hex[:10]}"
    text, _ = tokens.create(web.saga.records, name, "read")
    return name, text


def _reload(browser: Any) -> bool:
    browser.refresh()
    return False


def _click(browser: Any, css: str) -> bool:
    """Click ``css`` (False if a live update replaced it under the pointer: try again)."""
    from selenium.webdriver.common.by import By

    try:
        browser.find_element(By.CSS_SELECTOR, css).click()
    except Exception as exc:
        if replaced(exc):
            return False
        raise
    return True


def _post(browser: Any, path: str, *, with_csrf: bool) -> None:
    """Submit a form the page did not offer, as a forgery would."""
    browser.execute_script(
        """
        const form = document.createElement('form');
        form.method = 'post';
        form.action = arguments[0];
        if (arguments[1]) {
          const csrf = document.createElement('input');
          csrf.name = 'csrf';
          csrf.value = document.querySelector('input[name=csrf]').value;
          form.appendChild(csrf);
        }
        document.body.appendChild(form);
        form.submit();
        """,
        path,
        with_csrf,
    )
    until(browser, lambda: "Refused" in browser.page_source, "the refusal")
