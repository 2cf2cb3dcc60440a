-- stats.lua: the queue's state in one call.
-- KEYS[1] pending   LIST   light lane, head = oldest
-- KEYS[2] tokens    STRING sum of the tokens in both lanes
-- KEYS[3] leases    ZSET   batch_id -> lease deadline (ms)
-- KEYS[4] inflight  STRING claimed, unacknowledged items
-- KEYS[5] counters  HASH   event totals
-- KEYS[6] heavy     LIST   heavy lane, head = oldest
-- ARGV[1] now_ms override ("" or 0 = Redis TIME)
-- Returns {queued entries, queued tokens, oldest entry age ms, inflight items,
--          inflight batches, counters as a flat field/value list,
--          light entries, heavy entries, light tokens, heavy tokens}
-- A lane's tokens: the shorter lane's summed (scaled from its first LANE_SCAN entries when
-- longer), the other lane's the rest of the queued tokens.
--#include lib/common.lua

local LANE_SCAN = 1000

local oldest_age_ms = 0
for _, lane in ipairs({KEYS[1], KEYS[6]}) do
  local head = redis.call('LINDEX', lane, 0)
  if head then
    local ts_ms = tonumber(string.match(head, '^%d+::(%d+)::'))
    oldest_age_ms = math.max(now_ms(ARGV[1]) - ts_ms, oldest_age_ms)
  end
end
local light_entries, heavy_entries = redis.call('LLEN', KEYS[1]), redis.call('LLEN', KEYS[6])
local queued_tokens = tonumber(redis.call('GET', KEYS[2]) or '0')
local shorter, shorter_entries = KEYS[1], light_entries
if heavy_entries < light_entries then
  shorter, shorter_entries = KEYS[6], heavy_entries
end
local shorter_tokens = 0
if shorter_entries > 0 then
  local head = redis.call('LRANGE', shorter, 0, LANE_SCAN - 1)
  for i = 1, #head do
    shorter_tokens = shorter_tokens + tonumber(string.match(head[i], '^(%d+)::'))
  end
  shorter_tokens = math.min(queued_tokens, math.floor(shorter_tokens * shorter_entries / #head + 0.5))
end
local light_tokens, heavy_tokens = shorter_tokens, queued_tokens - shorter_tokens
if shorter == KEYS[6] then
  light_tokens, heavy_tokens = queued_tokens - shorter_tokens, shorter_tokens
end
return {
  light_entries + heavy_entries,
  queued_tokens,
  oldest_age_ms,
  tonumber(redis.call('GET', KEYS[4]) or '0'),
  redis.call('ZCARD', KEYS[3]),
  redis.call('HGETALL', KEYS[5]),
  light_entries, heavy_entries, light_tokens, heavy_tokens,
}
