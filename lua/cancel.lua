-- cancel.lua: cancel a request (its caller cancelled or timed out). O(1).
-- KEYS[1] reply     HASH   reply:<request_id>
-- KEYS[2] counters  HASH   cancelled
-- KEYS[3] cancelled STRING cancelled:<request_id>, set here for ARGV[1] ms (0: not set)
-- ARGV[1] cancelled_ttl_ms: how long a late enqueue of this request still finds the mark;
--         0 where the enqueue is known to have run (its answer came)
-- Only the reply hash goes: claims drop the entries as orphans, no LREM scan (docs/internals.md).
-- Returns 1 if the request was still live, else 0.
--#include lib/common.lua

local removed = redis.call('DEL', KEYS[1])
if tonumber(ARGV[1]) > 0 then
  redis.call('SET', KEYS[3], '1', 'PX', tonumber(ARGV[1]))
end
add_to_counter(KEYS[2], 'cancelled', removed)
return removed
