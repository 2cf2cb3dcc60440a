-- ack.lua: write a batch's results into their reply keys and release its lease, atomically;
-- or, partial, write some of its results early and keep the lease (a later ack releases it).
-- KEYS[1] leases    ZSET   batch_id -> lease deadline (ms)
-- KEYS[2] inflight  STRING claimed, unacknowledged items
-- KEYS[3] counters  HASH   acked (items answered with an embedding), failed (with an error)
-- KEYS[4] lease     LIST   lease:<batch_id>, the batch's entries
-- KEYS[5] lease_batch_counts HASH batch_id -> batch-class entries of its lease (claim.lua)
-- ARGV[1] reply key prefix
-- ARGV[2] batch_id
-- ARGV[3] '1': partial (store these results and send their notices; the lease, its unanswered
--         items and the inflight count are left as they are), '0': the final ack
-- ARGV[4..] (request_id, index, result) triples; result is tokq.queue.wire's '+' or '-' bytes
-- Idempotent (first write wins; only results stored now are counted); one notice per waiting
-- gateway (docs/internals.md). Returns {results stored, items released from the lease}
--#include lib/common.lua
--#include lib/entry.lua
--#include lib/reply.lua

local reply_prefix = ARGV[1]
local partial = ARGV[3] == '1'
local num_stored, num_errors = 0, 0 -- results stored; those of them that are errors
local OK_BYTE = string.byte('+')
local notices = {} -- one notice per waiting gateway for the whole batch (lib/reply.lua)
for i = 4, #ARGV, 3 do
  local result = ARGV[i + 2]
  if write_result(reply_prefix, ARGV[i], ARGV[i + 1], result, notices) == 1 then
    num_stored = num_stored + 1
    if string.byte(result, 1) ~= OK_BYTE then
      num_errors = num_errors + 1 -- the worker's error answer (refused, failed, non-finite)
    end
  end
end

if partial then
  publish_notices(notices)
  add_to_counter(KEYS[3], 'acked', num_stored - num_errors)
  add_to_counter(KEYS[3], 'failed', num_errors)
  return {num_stored, 0}
end

local entries = redis.call('LRANGE', KEYS[4], 0, -1)
local num_missing = 0
if #entries > (#ARGV - 3) / 3 then
  -- The worker answered fewer items than it claimed: answer the rest, or their requests
  -- would wait until their deadline.
  for _, raw in ipairs(entries) do
    local _, _, request_id, index = parse_entry(raw)
    num_missing = num_missing + write_result(reply_prefix, request_id, index,
      '-INTERNAL:the worker acknowledged the batch without a result for this item', notices)
  end
end
publish_notices(notices)
if #entries > 0 then
  redis.call('DEL', KEYS[4])
  redis.call('ZREM', KEYS[1], ARGV[2])
  redis.call('HDEL', KEYS[5], ARGV[2])
  add_to_count(KEYS[2], -#entries)
end
add_to_counter(KEYS[3], 'acked', num_stored - num_errors)
add_to_counter(KEYS[3], 'failed', num_errors + num_missing)
return {num_stored, #entries}
