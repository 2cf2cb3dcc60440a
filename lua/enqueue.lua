-- enqueue.lua: put all items of one request on the queue atomically, in FIFO order, or none.
-- KEYS[1] pending   LIST   entries, head = oldest
-- KEYS[2] tokens    STRING sum of the tokens in pending
-- KEYS[3] counters  HASH   enqueued, rejected (items)
-- KEYS[4] reply     HASH   reply:<request_id>, created here
-- ARGV[1] now_ms override ("" or 0 = Redis TIME)
-- ARGV[2] request_id (no ':')
-- ARGV[3] timeout_ms, relative: deadline_ms = now_ms + timeout_ms
-- ARGV[4] max_queued_tokens: the cap; a non-empty queue rejects a request that would pass it
-- ARGV[5] reply_ttl_ms: how long an uncollected reply outlives the deadline
-- ARGV[6] channel the completion notice is published on
-- ARGV[7..] (token_count, body) pairs, one per item
-- Returns {'OK', now_ms, deadline_ms} | {'QUEUE_FULL', queued_tokens} | {'DUPLICATE'}
--#include lib/common.lua
--#include lib/entry.lua

local now = now_ms(ARGV[1])
local request_id = ARGV[2]
local timeout_ms = tonumber(ARGV[3])
local deadline_ms = now + timeout_ms

local num_items = (#ARGV - 6) / 2
local request_tokens = 0
for i = 7, #ARGV, 2 do
  request_tokens = request_tokens + tonumber(ARGV[i])
end
-- An empty queue always takes one request, so no request is too big to ever be served.
local queued_tokens = tonumber(redis.call('GET', KEYS[2]) or '0')
if queued_tokens > 0 and queued_tokens + request_tokens > tonumber(ARGV[4]) then
  redis.call('HINCRBY', KEYS[3], 'rejected', num_items)
  return {'QUEUE_FULL', queued_tokens}
end
if redis.call('EXISTS', KEYS[4]) == 1 then
  return {'DUPLICATE'}
end

local entries = {}
for i = 7, #ARGV, 2 do
  local index = (i - 7) / 2
  entries[#entries + 1] = format_entry(tonumber(ARGV[i]), now, request_id, index, deadline_ms, 0, ARGV[i + 1])
end
push_values('RPUSH', KEYS[1], entries)
add_to_count(KEYS[2], request_tokens)
add_to_counter(KEYS[3], 'enqueued', num_items)
redis.call('HSET', KEYS[4], 'n', num_items, 'ch', ARGV[6])
redis.call('PEXPIRE', KEYS[4], timeout_ms + tonumber(ARGV[5]))
return {'OK', now, deadline_ms}
