-- cancel.lua: withdraw a request (its caller cancelled or timed out). O(1).
-- KEYS[1] reply     HASH   reply:<request_id>
-- KEYS[2] counters  HASH   cancelled
-- Only the reply key goes. Its entries still queued are dropped by the next claim that reaches
-- them (as orphans, their tokens taken off the count then); entries already claimed or being
-- requeued are dropped the same way, and ack writes nothing for them. Removing queued entries
-- here instead would cost a scan of the whole queue per entry (LREM), stalling Redis for
-- everyone exactly when timeouts come in bursts: under overload.
-- Returns 1 if the request was still live, else 0.
--#include lib/common.lua

local removed = redis.call('DEL', KEYS[1])
add_to_counter(KEYS[2], 'cancelled', removed)
return removed
