-- requeue.lua: put the items of expired leases back at the FRONT of the heavy lane (interactive
-- items) or of the batch lane (batch-class items: they keep their class) with attempt + 1;
-- items that reach max_attempts get an error result; items answered already (a partial ack) are
-- only released (docs/internals.md).
-- KEYS[1] leases    ZSET   batch_id -> lease deadline (ms)
-- KEYS[2] heavy     LIST   heavy lane, head = oldest
-- KEYS[3] tokens    STRING sum of the tokens in every lane
-- KEYS[4] inflight  STRING claimed, unacknowledged items
-- KEYS[5] counters  HASH   requeued, failed (answered with an error), orphaned
-- KEYS[6] idle      SET    idle workers' ids, their batch ids' prefix (lib/wake.lua)
-- KEYS[7] batch     LIST   batch lane, head = oldest
-- KEYS[8] batch_tokens STRING sum of the tokens in the batch lane
-- KEYS[9] lease_batch_counts HASH batch_id -> batch-class entries of its lease (the last ones)
-- ARGV[1] now_ms override ("" or 0 = Redis TIME)
-- ARGV[2] max_attempts
-- ARGV[3] max_batches handled per call
-- ARGV[4] reply key prefix, ARGV[5] lease key prefix (same hash tag)
-- ARGV[6] the queue's work shard channel: told when items come back and no idle worker is
--         registered (else one idle worker is woken on its worker channel)
-- ARGV[7] lease_ms, ARGV[8] worker channel prefix: a lease that missed a renewal whose worker's
--         channel (prefix + batch id up to its last '-') has no subscriber is redone now
-- Idempotent: a repeat finds the handled leases gone and does nothing.
-- Returns {items requeued, items failed, ms until the next lease expires or is due a check;
-- -1: no lease}: workers call again then.
--#include lib/common.lua
--#include lib/entry.lua
--#include lib/reply.lua
--#include lib/wake.lua

local now = now_ms(ARGV[1])
local max_attempts = tonumber(ARGV[2])
local reply_prefix, lease_prefix = ARGV[4], ARGV[5]

-- Oldest deadline first, so the longest-waiting batch ends up at the very front.
local half_lease = math.floor(tonumber(ARGV[7]) / 2)
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now + half_lease, 'WITHSCORES',
                       'LIMIT', 0, tonumber(ARGV[3]))
local batch_ids = {}
for i = 1, #due, 2 do
  local batch_id, deadline = due[i], tonumber(due[i + 1])
  local worker_id = string.match(batch_id, '^(.*)%-%d+$')
  if deadline <= now or (worker_id and redis.call('SPUBLISH', ARGV[8] .. worker_id, 'alive?') == 0) then
    batch_ids[#batch_ids + 1] = batch_id
  end
end
local back, back_tokens, num_failed, num_orphaned, num_released = {}, 0, 0, 0, 0
local back_batch, back_batch_tokens = {}, 0
local notices = {} -- one notice per waiting gateway (lib/reply.lua)
for _, batch_id in ipairs(batch_ids) do
  local lease = lease_prefix .. batch_id
  local entries = redis.call('LRANGE', lease, 0, -1)
  num_released = num_released + #entries
  -- The lease's last num_batch entries are batch-class (claim.lua).
  local first_batch = #entries - tonumber(redis.call('HGET', KEYS[9], batch_id) or '0') + 1
  for i, raw in ipairs(entries) do
    local tokens, _, request_id, index, _, attempt_text = parse_entry(raw)
    local attempt = tonumber(attempt_text)
    if redis.call('EXISTS', reply_prefix .. request_id) == 0 then
      num_orphaned = num_orphaned + 1
    elseif redis.call('HEXISTS', reply_prefix .. request_id, index) == 1 then
      -- answered already (ack.lua's partial mode): nothing to redo
    elseif attempt + 1 >= max_attempts then
      -- Counted as failed only if this error is its answer (not an earlier result's).
      num_failed = num_failed + write_result(reply_prefix, request_id, index, string.format(
        '-INTERNAL:item failed %d times (worker crashed or timed out)', attempt + 1), notices)
    elseif i >= first_batch then
      back_batch[#back_batch + 1] = with_attempt(raw, attempt + 1)
      back_batch_tokens = back_batch_tokens + tokens
    else
      back[#back + 1] = with_attempt(raw, attempt + 1)
      back_tokens = back_tokens + tokens
    end
  end
  redis.call('DEL', lease)
  redis.call('ZREM', KEYS[1], batch_id)
  redis.call('HDEL', KEYS[9], batch_id)
end
publish_notices(notices)
push_front(KEYS[2], back)
push_front(KEYS[7], back_batch)
if #back + #back_batch > 0 then
  wake_one(KEYS[6], ARGV[8], ARGV[6])
end
add_to_count(KEYS[3], back_tokens + back_batch_tokens)
add_to_count(KEYS[8], back_batch_tokens)
add_to_count(KEYS[4], -num_released)
add_to_counter(KEYS[5], 'requeued', #back + #back_batch)
add_to_counter(KEYS[5], 'failed', num_failed)
add_to_counter(KEYS[5], 'orphaned', num_orphaned)
-- The next event: the earliest lease expiring, or the first one not yet due a check becoming due.
local next_in_ms = -1
local earliest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if #earliest > 0 then
  next_in_ms = math.max(0, tonumber(earliest[2]) - now)
  local later = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. (now + half_lease), '+inf',
                           'WITHSCORES', 'LIMIT', 0, 1)
  if #later > 0 then
    next_in_ms = math.min(next_in_ms, tonumber(later[2]) - half_lease - now)
  end
end
return {#back + #back_batch, num_failed, next_in_ms}
