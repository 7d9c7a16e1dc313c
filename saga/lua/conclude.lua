-- ARGV: outcome ('compensated' | 'escalated' | 'completed' | 'failed_to_start'), reason,
--       owner (of the unwind that concludes), version ('' or the version the caller judged
--       the run at: 'moved' if it changed since)
-- Ends a run once: see _conclude_run.lua.
return conclude_run(ARGV[1], ARGV[2], ARGV[3], ARGV[4])
