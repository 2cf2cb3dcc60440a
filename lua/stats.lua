-- stats.lua: the queue's state in one call.
-- KEYS[1] pending   LIST   entries, head = oldest
-- KEYS[2] tokens    STRING sum of the tokens in pending
-- KEYS[3] leases    ZSET   batch_id -> lease deadline (ms)
-- KEYS[4] inflight  STRING claimed, unacknowledged items
-- KEYS[5] counters  HASH   event totals
-- ARGV[1] now_ms override ("" or 0 = Redis TIME)
-- Returns {queued entries, queued tokens, oldest entry age ms, inflight items,
--          inflight batches, counters as a flat field/value list}
--#include lib/common.lua

local oldest_age_ms = 0
local head = redis.call('LINDEX', KEYS[1], 0)
if head then
  local ts_ms = tonumber(string.match(head, '^%d+::(%d+)::'))
  oldest_age_ms = math.max(now_ms(ARGV[1]) - ts_ms, 0)
end
return {
  redis.call('LLEN', KEYS[1]),
  tonumber(redis.call('GET', KEYS[2]) or '0'),
  oldest_age_ms,
  tonumber(redis.call('GET', KEYS[4]) or '0'),
  redis.call('ZCARD', KEYS[3]),
  redis.call('HGETALL', KEYS[5]),
}
