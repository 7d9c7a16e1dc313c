"""``saga serve``: uvicorn running ``create_app`` as a factory (each worker process builds its
own app, with its own connections), settings from ``SAGA_API_*``."""

from __future__ import annotations

import uvicorn

from saga.web.settings import WebSettings


def serve(
    *,
    host: str | None = None,
    port: int | None = None,
    workers: int | None = None,
    root_path: str | None = None,
) -> None:
    settings = WebSettings.from_env()
    uvicorn.run(
        "saga.web.app:create_app",
        factory=True,
        host=host or settings.host,
        port=port or settings.port,
        workers=workers or settings.workers,
        root_path=(root_path if root_path is not None else settings.root_path).rstrip("/"),
        proxy_headers=True,
        server_header=False,
        timeout_graceful_shutdown=5,  # the console's live streams end with the server
        log_level="info",
    )
