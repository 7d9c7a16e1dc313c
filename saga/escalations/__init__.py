"""The escalation package: one document per escalation, for the person who takes the run over.

Built from an ``EscalationRecord`` (and the run's live picture or its run record, for the
timeline) as a versioned dict (``schema``, ``SCHEMA_VERSION``), rendered as JSON for scripts,
Markdown for a ticket and a terminal card; ``timeline`` draws a run as the seed does, for the
card, ``saga show`` and the demo alike.

    from saga.escalations import escalation_package, to_markdown
    print(to_markdown(escalation_package(record, picture)))
"""

from saga.escalations.card import run_card, to_rich
from saga.escalations.document import run_document, run_document_from_records, run_json
from saga.escalations.markdown import to_json, to_markdown
from saga.escalations.package import classify, escalation_package
from saga.escalations.schema import SCHEMA_VERSION, EscalationDoc, RunDoc, WhyKind
from saga.escalations.timeline import plain, timeline

__all__ = [
    "SCHEMA_VERSION",
    # Building the documents
    "EscalationDoc",
    "RunDoc",
    "WhyKind",
    "classify",
    "escalation_package",
    "run_document",
    "run_document_from_records",
    "run_json",
    # Rendering them
    "plain",
    "run_card",
    "timeline",
    "to_json",
    "to_markdown",
    "to_rich",
]
