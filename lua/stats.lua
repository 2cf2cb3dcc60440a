-- stats.lua: the queue's state in one call.
-- KEYS[1] pending   LIST   light lane, head = oldest
-- KEYS[2] tokens    STRING sum of the tokens in both lanes
-- KEYS[3] leases    ZSET   batch_id -> lease deadline (ms)
-- KEYS[4] inflight  STRING claimed, unacknowledged items
-- KEYS[5] counters  HASH   event totals
-- KEYS[6] heavy     LIST   heavy lane, head = oldest
-- ARGV[1] now_ms override ("" or 0 = Redis TIME)
-- Returns {queued entries, queued tokens, oldest entry age ms, inflight items,
--          inflight batches, counters as a flat field/value list}
--#include lib/common.lua

local oldest_age_ms = 0
for _, lane in ipairs({KEYS[1], KEYS[6]}) do
  local head = redis.call('LINDEX', lane, 0)
  if head then
    local ts_ms = tonumber(string.match(head, '^%d+::(%d+)::'))
    oldest_age_ms = math.max(now_ms(ARGV[1]) - ts_ms, oldest_age_ms)
  end
end
return {
  redis.call('LLEN', KEYS[1]) + redis.call('LLEN', KEYS[6]),
  tonumber(redis.call('GET', KEYS[2]) or '0'),
  oldest_age_ms,
  tonumber(redis.call('GET', KEYS[4]) or '0'),
  redis.call('ZCARD', KEYS[3]),
  redis.call('HGETALL', KEYS[5]),
}
