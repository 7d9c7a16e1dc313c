# Every target installs what it needs first (a local .venv from pyproject.toml), and the ones
# that need Redis run under scripts/with-redis, which starts a private redis-server when none
# answers at SAGA_REDIS_URL and stops it afterwards.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
# make bench RUNS=N (default 300) · make bench-agents RUNS=N (default 200)
# make bench-shards RUNS=N TOPOLOGY=T (default 300, single,cluster3)
# make chaos RUNS=N SEED=S (default 200, 1)
RUNS ?=
SEED ?= 1
TOPOLOGY ?= single,cluster3

# The demo's Saga: what the saga commands (requeue, resolve, reap) import, and whose module the
# worker, beat and Flower run. One variable, as in compose.yaml.
export SAGA_APP ?= tasks.app:saga
APP_MODULE = $(firstword $(subst :, ,$(SAGA_APP)))
# The image's dependencies (Dockerfile), pinned with hashes: `make lock` after changing them.
LOCK_EXTRAS := postgres metrics flower openai anthropic api

.PHONY: install demo test test-matrix test-lock lint bench bench-agents bench-instructions bench-peers bench-scale bench-shards chaos modelcheck worker turns beat flower lock clean

$(INSTALLED): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(INSTALLED)

install: $(INSTALLED)

demo: $(INSTALLED)
	scripts/with-redis $(BIN)/python -m tasks.demo

# Two pytest-xdist workers, a test file each at a time (its module fixtures stay whole): most
# tests wait on workers and servers they start, so two sessions share the two cores well.
# Each session has its own Redis databases, worker and demo data (tests/conftest.py).
test: $(INSTALLED)
	scripts/with-redis $(BIN)/python -m pytest -n 2 --dist loadfile

# The integration tier again on each other broker and store (tests/conftest.py): RabbitMQ in a
# vhost the session makes and deletes; a Sentinel master, replica and three sentinels it starts;
# a Redis Cluster of three masters and three replicas it starts (the broker stays on Redis or
# RabbitMQ: a cluster cannot be one).
test-matrix: $(INSTALLED)
	SAGA_TEST_BROKER=amqp scripts/with-redis $(BIN)/python -m pytest -n 2 --dist loadfile tests/integration
	SAGA_TEST_STORE=sentinel scripts/with-redis $(BIN)/python -m pytest -n 2 --dist loadfile tests/integration
	SAGA_TEST_BROKER=amqp SAGA_TEST_STORE=sentinel scripts/with-redis $(BIN)/python -m pytest -n 2 --dist loadfile tests/integration
	SAGA_TEST_STORE=cluster scripts/with-redis $(BIN)/python -m pytest -n 2 --dist loadfile tests/integration
	SAGA_TEST_BROKER=amqp SAGA_TEST_STORE=cluster scripts/with-redis $(BIN)/python -m pytest -n 2 --dist loadfile tests/integration

# The image's pinned dependencies (requirements.lock, what the Dockerfile installs) in a
# virtualenv of their own, the test tools beside them held to the same pins, and the whole
# suite run there as `make test` runs it: the versions the image ships are the versions tested.
LOCK_VENV := .venv-lock
$(LOCK_VENV)/.installed: requirements.lock pyproject.toml
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install --quiet --upgrade pip
	$(LOCK_VENV)/bin/pip install --quiet --require-hashes --no-deps -r requirements.lock
	sed -n 's/^\([A-Za-z0-9_.-]*==[^ ]*\).*/\1/p' requirements.lock > $(LOCK_VENV)/pins.txt
	$(LOCK_VENV)/bin/pip install --quiet -c $(LOCK_VENV)/pins.txt -e '.[dev]'
	touch $@

test-lock: $(LOCK_VENV)/.installed
	scripts/with-redis $(LOCK_VENV)/bin/python -m pytest -n 2 --dist loadfile

lint: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

bench: $(INSTALLED)
	scripts/with-redis $(BIN)/python benchmarks/overhead.py --runs $(or $(RUNS),300)

# saga against a bare Celery chain and DBOS Transact (PostgreSQL at SAGA_TEST_POSTGRES_URL, and
# SQLite), happy and failing, plain and durable; DBOS in its own virtualenv (.venv-peers).
# make bench-peers RUNS=N (runs per round, default 150). Starts its own redis-servers.
PEERS_VENV := .venv-peers
$(PEERS_VENV)/.installed: benchmarks/peers-requirements.txt
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install --quiet --upgrade pip
	$(PEERS_VENV)/bin/pip install --quiet -r benchmarks/peers-requirements.txt
	touch $(PEERS_VENV)/.installed

bench-peers: $(INSTALLED) $(PEERS_VENV)/.installed
	$(BIN)/python benchmarks/peers.py --runs $(or $(RUNS),150)

# Instructions per run, bare chain and saga, happy and failing, by process (caller, worker, pool
# process, Redis), counted by valgrind's callgrind: the reading of a run's work that does not
# move with the machine. Starts its own redis-server and worker under valgrind (about 13 min).
# make bench-instructions RUNS=N (measured runs per mode, default 20). Needs valgrind and gcc.
bench-instructions: $(INSTALLED)
	$(BIN)/python benchmarks/instructions.py --runs $(or $(RUNS),20)

# The cost of a step with 10, 1,000 and 10,000 runs open; the reaper's pass; Redis memory.
bench-scale: $(INSTALLED)
	$(BIN)/python benchmarks/scale.py

# The same driven and hosted runs against one Redis and a three-master Redis Cluster, each with
# its own servers, workers and broker (a plain redis-server: it is never counted as the store):
# Redis CPU and commands per run on each shard, runs/s, each shard's projected ceiling, and the
# hottest key's share of the store's commands (MONITOR). TOPOLOGY=single or cluster3 for one.
bench-shards: $(INSTALLED)
	$(BIN)/python benchmarks/shards.py --runs $(or $(RUNS),300) --topology $(TOPOLOGY)

# Hosted agent runs enqueued at once against the same runs driven from threads (it starts its
# own turn and tool workers).
bench-agents: $(INSTALLED)
	scripts/with-redis $(BIN)/python benchmarks/agents.py --runs $(or $(RUNS),200)

# The randomised chaos run alone (it starts its own redis-server, two tool workers and a
# turn worker; a quarter of its runs are hosted agent runs). STORE=sentinel: the store on a
# master, a replica and three sentinels of its own, failed over every 20 s among the kills;
# STORE=cluster: the store on a Redis Cluster of its own (three masters, a replica each), the
# broker on a plain Redis of its own, a random master failed over every 20 s, by CLUSTER
# FAILOVER and by SIGKILL (the node restarted as a replica) in turn; BROKER=amqp: the broker on
# a RabbitMQ node of its own, its connections dropped or the node restarted every 25 s;
# BROKER=split: the broker on a Redis of its own without persistence, emptied every 25 s.
chaos: $(INSTALLED)
	$(BIN)/python -m tests.reliability.chaos --runs $(or $(RUNS),200) --seed $(SEED) \
	  --store $(or $(STORE),redis) --broker $(or $(BROKER),redis)

# The model checks, long profile (each job starts its own redis-server): the engine's state
# machines (EXAMPLES), then the hosted agent loop's turns, lease, approvals and revivals
# (HOSTED_EXAMPLES). make modelcheck EXAMPLES=N HOSTED_EXAMPLES=M SEED=S JOBS=J (default
# 12000, 10000, 1, 2: one job per core); both run, and it fails if either finds a violation.
EXAMPLES ?= 12000
HOSTED_EXAMPLES ?= 10000
JOBS ?= 2
modelcheck: $(INSTALLED)
	$(BIN)/python -m tests.reliability.modelcheck --examples $(EXAMPLES) --seed $(SEED) --jobs $(JOBS); \
	engine=$$?; \
	$(BIN)/python -m tests.reliability.modelcheck_hosted --examples $(HOSTED_EXAMPLES) --seed $(SEED) --jobs $(JOBS); \
	hosted=$$?; \
	test $$engine -eq 0 -a $$hosted -eq 0

# Each worker has a node name of its own (-n): two under one name hide each other from Flower
# and from `saga doctor`.
worker: $(INSTALLED)
	$(BIN)/celery -A $(APP_MODULE) worker -n tools@%h -Q celery -E --loglevel INFO

# Hosted agents' turns: a threads pool on its own queue (a model call never holds a prefork slot).
turns: $(INSTALLED)
	$(BIN)/celery -A $(APP_MODULE) worker -n turns@%h -P threads -c 50 -Q saga.turns -E --loglevel INFO

beat: $(INSTALLED)
	$(BIN)/celery -A $(APP_MODULE) beat --loglevel INFO

# Read-only Flower behind SAGA_FLOWER_BASIC_AUTH=user:password (or, on a development machine,
# SAGA_FLOWER_INSECURE_LOCAL=1: no password, 127.0.0.1 only). docs/deployment.md.
flower: $(INSTALLED)
	$(BIN)/python -m saga.integrations.flower -A $(APP_MODULE) --port=5555

lock: $(INSTALLED)
	printf 'setuptools>=77\n' | $(BIN)/uv pip compile pyproject.toml - \
		$(foreach extra,$(LOCK_EXTRAS),--extra $(extra)) --generate-hashes \
		--python-version 3.11 --python-platform linux --quiet -o requirements.lock

clean:
	rm -rf $(VENV) $(PEERS_VENV) $(LOCK_VENV) .demo-data .pytest_cache .mypy_cache .ruff_cache *.egg-info
