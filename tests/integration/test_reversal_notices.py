"""A person is told when an unwind waits for their answer about a costly reversal: the
notification sinks get one notice per question (signed, with the question, its hash and the
commands that answer it), however often the compensation's delivery finds it open; a question
that expires unanswered escalates, and the escalation (its notice, card and Markdown) names it;
a requeue asks again, and the card shows that question with its commands.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from rich.console import Console

from saga import RunState
from saga.escalations import escalation_package, to_markdown, to_rich
from saga.notifications import NoticeState
from tests.integration.helpers import wait_until
from tests.integration.reversal_deployment import Asking, asking_deployment

pytestmark = pytest.mark.timeout(180)

#: Seconds a question waits for its answer here, before the reaper may expire it.
ASK_SECONDS = 3


@pytest.fixture(scope="module")
def asking(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Asking]:
    extra = {"SAGA_REVERSAL_ASK_SECONDS": str(ASK_SECONDS)}
    with asking_deployment(tmp_path_factory.mktemp("reversal-notices"), extra) as made:
        yield made


def _card(asking: Asking, escalation_id: str) -> tuple[dict, str, str]:  # type: ignore[type-arg]
    record = asking.saga.records.escalation(escalation_id)
    assert record is not None
    doc = escalation_package(record, asking.saga.picture(record.run_id))
    console = Console(record=True, width=400, color_system=None)
    console.print(to_rich(doc))
    return dict(doc), to_markdown(doc), console.export_text()


def test_a_question_is_told_once_and_its_expiry_escalates_naming_it(asking: Asking) -> None:
    # Given an unwind that waits for a person at a $2,500 credit's reversal
    run, asked = asking.asked()
    notice_id = f"{run.run_id}:0:asked:2"

    # Then the webhook gets the question: signed, with its hash and the commands answering it
    wait_until(lambda: asking.receiver.of(notice_id), 30, "the question's notice")
    [post] = asking.receiver.of(notice_id)
    body = post.body
    assert post.verified and body["id"] == notice_id and body["type"] == "saga.reversal_question"
    assert body["open"] is True and body["run_id"] == run.run_id and body["step"] == 2
    question = body["question"]
    assert (question["tool"], question["args_hash"]) == ("reverse_credit", asked.ask_hash)
    assert "costly(args, result) was true" in question["why"] and question["until"]
    assert f"reversal {run.run_id} 2 --keep" in body["commands"]["keep"]
    assert f"--hash {asked.ask_hash}" in body["commands"]["reverse"]
    assert f"/api/runs/{run.run_id}/reversals/2" in body["commands"]["api"]
    assert body["run"]["questions"] == [question]  # the run document, and its drawing
    assert "a person is asked: reverse, keep or later" in body["timeline"]

    # Once per question: the delivery that finds it open again (a redelivery) sends nothing
    notices = asking.saga.notifier.store
    wait_until(
        lambda: [n.state for n in notices.notices(notice_id)] == [NoticeState.SENT.value],
        20,
        "the notice recorded sent",
    )
    assert asking.saga.notifier.asked(run.run_id, 2) == []
    asking.saga.core.reversal_asked(run.run_id, 2)
    time.sleep(1.0)
    assert len(asking.receiver.of(notice_id)) == 1

    # When nobody answers in time, the reaper escalates: the escalation names the question
    time.sleep(max(0.0, (asked.ask_expires or 0) - asking.saga.store.now()) + 0.2)
    assert asking.saga.reap().unanswered == [(run.run_id, 2)]
    assert run.wait(timeout=30).state is RunState.ESCALATED
    escalation_id = f"{run.run_id}:0"
    wait_until(lambda: asking.receiver.of(escalation_id), 30, "the escalation's notice")
    assert "unanswered" in asking.receiver.of(escalation_id)[0].body["why"]["also"]
    doc, markdown, card = _card(asking, escalation_id)
    assert "unanswered" in doc["why"]["also"]
    assert "Asked and not answered" in markdown and "did not answer by" in markdown
    assert "Asked and not answered" in card and "a requeue asks the question again" in card
    bob = asking.console(asking.read_token)
    page = bob.get(f"/console/escalations/{escalation_id}").text
    assert "Asked and not answered:" in page and "did not answer by 20" in page

    # And a requeue asks again: a new question, a new notice, on the escalation's card
    asking.saga.requeue_failed_compensations(run.run_id, by="ada")
    wait_until(lambda: asking.receiver.of(f"{run.run_id}:1:asked:2"), 30, "the new question")
    again = asking.undo(run, 2)
    doc, markdown, card = _card(asking, escalation_id)
    [answers] = doc["commands"]["answer_reversal"]
    assert answers["keep"].endswith(f"--hash {again.ask_hash}")
    assert "A PERSON DECIDES" in card and answers["reverse"] in card
    assert "### A person decides: reverse step 2?" in markdown and answers["later"] in markdown
    assert again.ask_hash in markdown and "costly(args, result)" in markdown
    page = bob.get(f"/console/escalations/{escalation_id}").text
    assert "The run waits for a person now" in page
