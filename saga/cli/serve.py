"""``saga serve``: the HTTP API and the console (``saga.web``) under uvicorn, configured by
SAGA_API_HOST, SAGA_API_PORT, SAGA_API_WORKERS and SAGA_API_ROOT_PATH (flags override)."""

from __future__ import annotations

import click

from saga.cli.context import ExitCode, Failure
from saga.extras import missing


@click.command()
@click.option("--host", help="Listen address (SAGA_API_HOST, default 127.0.0.1).")
@click.option("--port", type=click.IntRange(1, 65535), help="SAGA_API_PORT, default 8000.")
@click.option("--workers", type=click.IntRange(1, 64), help="SAGA_API_WORKERS, default 1.")
@click.option("--root-path", help="Path prefix behind a proxy (SAGA_API_ROOT_PATH).")
def serve(host: str | None, port: int | None, workers: int | None, root_path: str | None) -> None:
    """Serve the HTTP API (/api), the console (/console) and health (/health/live, /health/ready)
    (`pip install 'saga-compensation[api]'`). Requeue and resolve need SAGA_APP=module:attr."""
    try:
        # The app itself, not only the server: uvicorn imports the app later, by name, where
        # a missing FastAPI would be a traceback.
        import saga.web.app  # noqa: F401

        # Imported on use: `saga --help` loads none of a command's imports.
        from saga.web.server import serve as run
    except ModuleNotFoundError as exc:
        error = missing(exc, "for saga serve")
        if error is None:
            raise
        raise Failure(str(error), ExitCode.MISSING_EXTRA) from exc
    run(host=host, port=port, workers=workers, root_path=root_path)
