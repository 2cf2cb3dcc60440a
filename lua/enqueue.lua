-- enqueue.lua: put all items of one request on the queue atomically, in FIFO order, or none.
-- KEYS[1] pending   LIST   light lane: entries of interactive requests of <= light_tokens, head = oldest
-- KEYS[2] tokens    STRING sum of the tokens in every lane
-- KEYS[3] counters  HASH   enqueued, rejected, rejected_batch (items)
-- KEYS[4] reply     HASH   reply:<request_id>, created here
-- KEYS[5] heavy     LIST   heavy lane: entries of larger interactive requests (tokq/queue/claim_rule.py)
-- KEYS[6] idle      SET    idle workers' ids, their batch ids' prefix (lib/wake.lua)
-- KEYS[7] preemptible SET  ids of workers in a heavy forward: one is told 'light' when
--                          the light lane stops being empty and no idle worker was woken
-- KEYS[8] cancelled STRING cancelled:<request_id> (cancel.lua): this request was cancelled
-- KEYS[9] batch     LIST   batch lane: entries of batch-class requests
-- KEYS[10] batch_tokens STRING sum of the tokens in the batch lane
-- ARGV[1] now_ms override ("" or 0 = Redis TIME)
-- ARGV[2] request_id (no ':')
-- ARGV[3] timeout_ms, relative: deadline_ms = now_ms + timeout_ms
-- ARGV[4] the request's class's cap on its queued tokens (interactive: every lane's tokens less
--         the batch lane's; batch: the batch lane's); a class holding tokens rejects a request
--         that would pass it
-- ARGV[5] reply_ttl_ms: how long an uncollected reply outlives the deadline
-- ARGV[6] the gateway's notice channel (a shard channel): the reply's notice is published on it
-- ARGV[7] the queue's work shard channel: told when the queue stops being empty and no idle
--         worker is registered
-- ARGV[8] light_tokens: a request of at most this many tokens in all goes in the light lane
-- ARGV[9] worker channel prefix: one idle worker is woken on its own channel
-- ARGV[10] priority: "interactive" or "batch" (tokq/queue/priority.py)
-- ARGV[11..] (token_count, body) pairs, one per item
-- Idempotent by request id: a repeat gets the first run's answer, never QUEUE_FULL; QUEUE_FULL
-- and CANCELLED (cancelled before this run) queue nothing (docs/internals.md).
-- Returns {'OK', ts_ms, deadline_ms} | {'QUEUE_FULL', the class's queued tokens} | {'DUPLICATE'}
--   | {'CANCELLED'}
--#include lib/common.lua
--#include lib/entry.lua
--#include lib/wake.lua

local FIRST_ITEM = 11
local num_items = (#ARGV - FIRST_ITEM + 1) / 2
if redis.call('EXISTS', KEYS[8]) == 1 then
  return {'CANCELLED'}
end
local first = redis.call('HMGET', KEYS[4], 'n', 't')
if first[1] then
  if tonumber(first[1]) ~= num_items then
    return {'DUPLICATE'} -- a different request under a reused id
  end
  local ts_ms, deadline = string.match(first[2], '^(%d+):(%d+)$')
  return {'OK', tonumber(ts_ms), tonumber(deadline)}
end

local now = now_ms(ARGV[1])
local request_id = ARGV[2]
local timeout_ms = tonumber(ARGV[3])
local deadline_ms = now + timeout_ms

local request_tokens = 0
for i = FIRST_ITEM, #ARGV, 2 do
  request_tokens = request_tokens + tonumber(ARGV[i])
end
-- Each class has its own cap: a bulk backlog never refuses interactive work. A class holding
-- no tokens always takes one request, so no request is too big to ever be served.
local in_batch = ARGV[10] == 'batch'
local queued_tokens = tonumber(redis.call('GET', KEYS[2]) or '0')
local batch_tokens = tonumber(redis.call('GET', KEYS[10]) or '0')
local class_tokens = in_batch and batch_tokens or queued_tokens - batch_tokens
if class_tokens > 0 and class_tokens + request_tokens > tonumber(ARGV[4]) then
  redis.call('HINCRBY', KEYS[3], 'rejected', num_items)
  if in_batch then
    redis.call('HINCRBY', KEYS[3], 'rejected_batch', num_items)
  end
  return {'QUEUE_FULL', class_tokens}
end

local entries = {}
for i = FIRST_ITEM, #ARGV, 2 do
  local index = (i - FIRST_ITEM) / 2
  entries[#entries + 1] = format_entry(tonumber(ARGV[i]), now, request_id, index, deadline_ms, 0, ARGV[i + 1])
end
local light = not in_batch and request_tokens <= tonumber(ARGV[8])
local light_was_empty = light and redis.call('LLEN', KEYS[1]) == 0
local lane = in_batch and KEYS[9] or (light and KEYS[1] or KEYS[5])
push_values('RPUSH', lane, entries)
add_to_count(KEYS[2], request_tokens)
if in_batch then
  add_to_count(KEYS[10], request_tokens)
end
add_to_counter(KEYS[3], 'enqueued', num_items)
redis.call('HSET', KEYS[4], 'n', num_items, 'ch', ARGV[6], 't', string.format('%d:%d', now, deadline_ms))
redis.call('PEXPIRE', KEYS[4], timeout_ms + tonumber(ARGV[5]))
-- Only the queue's or light lane's empty -> non-empty step wakes one idle worker (its claim wakes
-- the next); light work no idle worker takes goes to a worker in a heavy forward, to run nested.
local woken = 0
if queued_tokens == 0 or light_was_empty then
  woken = wake_one(KEYS[6], ARGV[9], nil)
end
if woken == 0 and light_was_empty then
  woken = wake_one(KEYS[7], ARGV[9], nil, 'light')
end
if woken == 0 and queued_tokens == 0 then
  redis.call('SPUBLISH', ARGV[7], '1')
end
return {'OK', now, deadline_ms}
