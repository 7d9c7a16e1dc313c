# syntax=docker/dockerfile:1
# saga's image (docs/deployment.md). Three stages:
#   build    the dependencies from requirements.lock (pinned, with hashes: `make lock`), then
#            saga itself, installed (not editable), so the Lua scripts and the migrations are
#            inside the installed package;
#   runtime  that virtualenv and a non-root user, nothing to build with: the base for an
#            application's own image (FROM it, COPY the app, set SAGA_APP);
#   demo     runtime plus the demo app (tasks/, celeryconfig.py): what compose.yaml runs.
# Nothing is installed when a container starts.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/saga
COPY requirements.lock /tmp/requirements.lock
RUN /opt/saga/bin/pip install --require-hashes --no-deps -r /tmp/requirements.lock
COPY pyproject.toml README.md LICENSE /src/
COPY saga /src/saga
# The lock holds setuptools too: the build needs nothing that was not hashed.
RUN /opt/saga/bin/pip install --no-deps --no-build-isolation /src \
    && /opt/saga/bin/python -c "import saga.stack, saga.records.migrations"

FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --system --gid 10001 saga \
    && useradd --system --uid 10001 --gid saga --home-dir /app --shell /usr/sbin/nologin saga \
    && mkdir -p /app /data \
    && chown saga:saga /data
COPY --from=build /opt/saga /opt/saga
ENV PATH=/opt/saga/bin:$PATH \
    PYTHONPATH=/app \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /app
USER saga:saga
CMD ["saga", "--help"]

FROM runtime AS demo
# Owned by root, read-only to the user that runs it.
COPY --chown=root:root celeryconfig.py /app/
COPY --chown=root:root tasks /app/tasks
ENV SAGA_APP=tasks.app:saga \
    SAGA_DEMO_DATA=/data
