"""A person decides before a costly reversal, in the console: the run page shows the undo the
unwind waits at (the tool, its captured arguments, why it asks, since and until when, the
hash) and takes the answer (reverse, keep with a note, later) through the operation the API
and ``saga reversal`` use, bound to that hash. In headless Chromium against ``saga serve``
(as ``test_console.py``), and through the routes for the refusals: a ``read`` login cannot
answer, a stale hash is refused saying so.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from saga import RunState
from saga.model import CompensationState
from saga.rules import REASON_KEPT
from saga.runs import Run
from tasks import systems
from tests.integration.reversal_deployment import Asking, asking_deployment
from tests.integration.web import test_console as in_chromium
from tests.integration.web.conftest import login_value, serving

pytestmark = pytest.mark.timeout(240)

#: Headless Chromium with a fresh profile (``test_console.py``'s).
browser = in_chromium.browser


@pytest.fixture(scope="module")
def asking(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Asking]:
    with asking_deployment(tmp_path_factory.mktemp("reversals")) as made:
        yield made


@pytest.fixture(scope="module")
def server(asking: Asking) -> Iterator[str]:
    with serving(asking.env, asking.data) as url:
        yield url


def _ledger(run: Run) -> list[str]:
    return [
        r["kind"] for r in systems.ledger() if r["idempotency_key"].startswith(f"{run.run_id}:")
    ]


def _answer(client: TestClient, run: Run, decision: str, **fields: str) -> Any:
    page = client.get(f"/console/runs/{run.run_id}")
    form = {"csrf": login_value(page.text), **fields}
    return client.post(
        f"/console/runs/{run.run_id}/reversals/2/{decision}", data=form, follow_redirects=False
    )


# -- in Chromium -------------------------------------------------------------------------------


def test_keep_with_a_note_and_reverse_from_the_run_page(
    asking: Asking, server: str, browser: Any
) -> None:
    """alice opens a run whose unwind waits at a $2,500 credit's reversal: the page says what
    would run, with what, why, until when; she keeps it with a note and the run ends escalated
    and resolved, the credit kept (=). Another such run she reverses: it ends compensated."""
    from selenium.webdriver.common.by import By

    systems.reset()
    kept, asked = asking.asked()
    in_chromium.log_in(browser, server, asking.operate_token)
    browser.get(f"{server}/console/runs/{kept.run_id}")
    # Once the live section has replaced the first render (nothing moves after: the run waits)
    in_chromium.until(
        browser, lambda: browser.find_element(By.ID, "run").get_attribute("data-updated"), "live"
    )
    question = in_chromium.text_of(browser, ".reversal")
    assert "reverse_credit" in question and "credit_id" in question
    assert "costly(args, result) was true" in in_chromium.text_of(browser, ".reversal .why")
    assert "UTC" in in_chromium.text_of(browser, ".reversal .until")
    assert in_chromium.text_of(browser, ".reversal .hash") == asked.ask_hash
    assert "Waiting for a person" in in_chromium.text_of(browser, ".banner.ask")
    in_chromium.shot(browser, "run-reversal-asked.png")

    note = browser.find_element(By.CSS_SELECTOR, ".reversal form.keep input[name=note]")
    note.send_keys("goodwill, approved by finance")
    browser.find_element(By.CSS_SELECTOR, ".reversal form.keep button").click()
    in_chromium.until(
        browser, lambda: in_chromium.text_of(browser, "#run-state") == "escalated", "escalated"
    )
    ended = kept.wait(timeout=30)
    assert (ended.state, ended.reason) == (RunState.ESCALATED, REASON_KEPT)
    undo = asking.undo(kept, 2)
    assert undo.state is CompensationState.KEPT
    assert [(d["decision"], d["by"], d["note"]) for d in undo.decisions] == [
        ("keep", "alice", "goodwill, approved by finance")
    ]
    assert _ledger(kept) == ["credit"]  # never reversed
    escalation = asking.saga.records.escalation(f"{kept.run_id}:0")
    assert escalation is not None and escalation.resolved and escalation.resolved_by == "alice"
    in_chromium.until(browser, lambda: "kept" in in_chromium.text_of(browser, "#unwind"), "kept")
    resolved = in_chromium.text_of(browser, ".banner.resolved")  # closed by the decision
    assert "resolved by alice" in resolved and "goodwill, approved by finance" in resolved
    assert not browser.find_elements(By.CSS_SELECTOR, ".banner.bad")  # nothing left open
    in_chromium.shot(browser, "run-reversal-kept.png")

    # The other run: listed among what awaits a person, then reversed from its page
    reversed_, _ = asking.asked()
    browser.get(f"{server}/console/approvals")
    assert reversed_.run_id in in_chromium.text_of(browser, "#reversals")
    browser.get(f"{server}/console/runs/{reversed_.run_id}")
    in_chromium.until(
        browser, lambda: browser.find_element(By.ID, "run").get_attribute("data-updated"), "live"
    )
    browser.find_element(By.CSS_SELECTOR, ".reversal form.reverse button").click()
    in_chromium.until(
        browser,
        lambda: in_chromium.text_of(browser, "#run-state") == "compensated",
        "compensated",
    )
    assert reversed_.wait(timeout=30).state is RunState.COMPENSATED
    assert asking.undo(reversed_, 2).state is CompensationState.DONE
    assert _ledger(reversed_) == ["credit", "reversal"]


# -- the route's refusals ----------------------------------------------------------------------


def test_a_read_login_sees_the_question_and_cannot_answer(asking: Asking) -> None:
    run, asked = asking.asked()
    bob = asking.console(asking.read_token)
    page = bob.get(f"/console/runs/{run.run_id}").text
    assert asked.ask_hash in page and "reverse_credit" in page
    assert "/reversals/" not in page  # no form to answer with
    # Posting the answer anyway, CSRF token and all: refused, nothing changed
    refused = _answer(bob, run, "keep", args_hash=asked.ask_hash, note="bob keeps it")
    assert refused.status_code == 403 and "may only read" in refused.text
    assert asking.undo(run, 2).state is CompensationState.ASKED
    assert asking.undo(run, 2).decisions == []


def test_a_stale_hash_a_keep_without_a_note_and_a_second_answer_are_refused(
    asking: Asking,
) -> None:
    run, asked = asking.asked()
    alice = asking.console(asking.operate_token)
    # A hash that is not the asked undo's: refused, saying so on the page
    stale = _answer(alice, run, "reverse", args_hash="0" * 40)
    assert stale.status_code == 409
    assert re.search(r"the undo you were shown is not the one asked about", stale.text)
    # A keep needs a note
    bare = _answer(alice, run, "keep", args_hash=asked.ask_hash)
    assert bare.status_code == 422 and "note: required" in bare.text
    assert asking.undo(run, 2).state is CompensationState.ASKED and _ledger(run) == ["credit"]
    # The answer is taken once: a second one (another tab) is told who answered
    taken = _answer(alice, run, "keep", args_hash=asked.ask_hash, note="goodwill")
    assert taken.status_code == 303
    again = _answer(alice, run, "reverse", args_hash=asked.ask_hash)
    assert again.status_code == 409 and "kept already: keep by alice" in again.text
    assert run.wait(timeout=30).reason == REASON_KEPT


def test_later_puts_the_question_off_from_the_console(asking: Asking) -> None:
    run, asked = asking.asked()
    alice = asking.console(asking.operate_token)
    assert _answer(alice, run, "later", args_hash=asked.ask_hash).status_code == 303
    later = asking.undo(run, 2)
    assert later.state is CompensationState.ASKED
    assert later.ask_expires is not None and asked.ask_expires is not None
    assert later.ask_expires > asked.ask_expires
    page = alice.get(f"/console/runs/{run.run_id}").text
    assert "later by alice" in page  # the earlier answer, beside the question
