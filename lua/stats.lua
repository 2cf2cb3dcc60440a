-- stats.lua: the queue's state in one call.
-- KEYS[1] pending   LIST   light lane, head = oldest
-- KEYS[2] tokens    STRING sum of the tokens in every lane
-- KEYS[3] leases    ZSET   batch_id -> lease deadline (ms)
-- KEYS[4] inflight  STRING claimed, unacknowledged items
-- KEYS[5] counters  HASH   event totals
-- KEYS[6] heavy     LIST   heavy lane, head = oldest
-- KEYS[7] batch     LIST   batch lane (batch-class work), head = oldest
-- KEYS[8] batch_tokens STRING sum of the tokens in the batch lane
-- ARGV[1] now_ms override ("" or 0 = Redis TIME)
-- Returns {queued entries, queued tokens, oldest entry age ms, inflight items,
--          inflight batches, counters as a flat field/value list,
--          light entries, heavy entries, light tokens, heavy tokens,
--          batch entries, batch tokens, oldest interactive age ms, oldest batch age ms}
-- The batch lane's tokens are exact. Of the interactive tokens (every lane's less the batch
-- lane's), the shorter interactive lane's are summed (scaled from its first LANE_SCAN entries
-- when longer), the other lane's are the rest.
--#include lib/common.lua

local LANE_SCAN = 1000

local now = now_ms(ARGV[1])
local function head_age(lane)
  local head = redis.call('LINDEX', lane, 0)
  if head then
    return math.max(0, now - tonumber(string.match(head, '^%d+::(%d+)::')))
  end
  return 0
end
local interactive_age = math.max(head_age(KEYS[1]), head_age(KEYS[6]))
local batch_age = head_age(KEYS[7])
local light_entries, heavy_entries = redis.call('LLEN', KEYS[1]), redis.call('LLEN', KEYS[6])
local batch_entries = redis.call('LLEN', KEYS[7])
local queued_tokens = tonumber(redis.call('GET', KEYS[2]) or '0')
local batch_tokens = tonumber(redis.call('GET', KEYS[8]) or '0')
local interactive_tokens = math.max(0, queued_tokens - batch_tokens)
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
  shorter_tokens = math.min(interactive_tokens, math.floor(shorter_tokens * shorter_entries / #head + 0.5))
end
local light_tokens, heavy_tokens = shorter_tokens, interactive_tokens - shorter_tokens
if shorter == KEYS[6] then
  light_tokens, heavy_tokens = interactive_tokens - shorter_tokens, shorter_tokens
end
return {
  light_entries + heavy_entries + batch_entries,
  queued_tokens,
  math.max(interactive_age, batch_age),
  tonumber(redis.call('GET', KEYS[4]) or '0'),
  redis.call('ZCARD', KEYS[3]),
  redis.call('HGETALL', KEYS[5]),
  light_entries, heavy_entries, light_tokens, heavy_tokens,
  batch_entries, batch_tokens, interactive_age, batch_age,
}
