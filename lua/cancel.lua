-- cancel.lua: withdraw a request (its caller cancelled or timed out). O(1).
-- KEYS[1] reply     HASH   reply:<request_id>
-- KEYS[2] counters  HASH   cancelled
-- KEYS[3] withdrawn STRING withdrawn:<request_id>, set here for ARGV[1] ms (0: not set)
-- ARGV[1] withdrawn_ttl_ms: how long an enqueue of this request that Redis runs late (its
--         answer lost on a connection given up, while Redis stalled) still finds it withdrawn;
--         0 where the enqueue is known to have run (its answer came): the usual case
-- Only the reply key goes. Its entries still queued are dropped by the next claim that reaches
-- them (as orphans, their tokens taken off the count then); entries already claimed or being
-- requeued are dropped the same way, and ack writes nothing for them. Removing queued entries
-- here instead would cost a scan of the whole queue per entry (LREM), stalling Redis for
-- everyone exactly when timeouts come in bursts: under overload. The mark makes a late
-- enqueue.lua of the same request queue nothing (else its entries would be embedded for
-- nobody and its reply key live to its deadline).
-- Returns 1 if the request was still live, else 0.
--#include lib/common.lua

local removed = redis.call('DEL', KEYS[1])
if tonumber(ARGV[1]) > 0 then
  redis.call('SET', KEYS[3], '1', 'PX', tonumber(ARGV[1]))
end
add_to_counter(KEYS[2], 'cancelled', removed)
return removed
