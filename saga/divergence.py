"""A store that went back in time: keys of a run older than what SQL recorded of it.

Replication is asynchronous, so a failover to a replica that missed the last writes, or an old
master that resynced from the new one, can leave a run's keys older than its SQL record (a run
SQL says completed is running at step 2 again). Acting on such keys would reverse finished
work. Whoever would act on a run from its keys alone (the reaper, ``Core.start_unwind``) asks
this first, and a run found behind is escalated to a person instead (``docs/durability.md``).
"""

from __future__ import annotations

from saga.model import RunState
from saga.records import RecordStore
from saga.stack import RunStore


def behind_records(
    records: RecordStore,
    store: RunStore,
    run_id: str,
    state: RunState,
    version: str,
    recorded_version: str | None,
) -> str:
    """What diverged, if the run's keys (in ``state`` at ``version``, having ended at or seen
    recorded ``recorded_version``) are older than that record; ``""`` when they are not, or
    it cannot be judged (no record).

    Keys of a lower version than the record are older. So are the keys of a run not ended
    that never reached the end the record holds, whatever their version (what was done after
    going back bumped it); a requeue, a resolution or an effect that landed late moves on from
    keys that reached it (a requeue may come between the record's write and its mark: the
    conclusion itself sets ``recorded_version``). Keys from before ``recorded_version`` was
    kept are judged by their version alone. Raises what the database raises (the caller
    tries again later)."""
    recorded_state, sql = records.recorded_as(run_id) or ("", None)
    if sql is None:
        return ""

    def older(state: RunState, version: str, recorded_version: str | None) -> bool:
        if not version.isdigit():
            return False
        if int(version) < sql:
            return True
        if state.ended or recorded_version is None:
            return False
        return int(recorded_version or 0) < sql

    if not older(state, version, recorded_version):
        return ""
    # That reading may be older than the record without the keys being so: the reaper's
    # picture, read before the run moved on and was recorded. The keys as they are now, read
    # after the record, decide.
    now = store.head(run_id)
    if now is None or not older(now.state, now.version, now.recorded_version):
        return ""
    seen = "no end" if now.recorded_version in (None, "", "0") else f"v{now.recorded_version}"
    return (
        f"SQL recorded it {recorded_state} at version {sql}; its Redis keys say "
        f"{now.state.value} at version {now.version}, having reached {seen}"
    )
