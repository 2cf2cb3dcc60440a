-- lib/reply.lua: writing one item's result into its request's reply HASH.
-- The hash holds `n` (item count), `ch` (the gateway's shard channel), `t` ("ts_ms:deadline_ms",
-- for a repeated enqueue) and one field per answered item index. The first result for an
-- index wins (HSETNX), so a redone or late ack is never seen twice; the write that completes
-- the request SPUBLISHes its id on `ch` (sharded pub/sub: the channel carries the queue's hash
-- tag, so on Redis Cluster the notice stays on the queue's node). A reply hash that no longer
-- exists (collected, cancelled or expired) gets nothing: a late ack must not resurrect it.
-- Returns 1 when a new result was stored, else 0.
local REPLY_META_FIELDS = 3 -- n, ch, t (tokq.queue.REPLY_META_FIELDS)
local function write_result(reply_prefix, request_id, index, result)
  local reply = reply_prefix .. request_id
  if redis.call('EXISTS', reply) == 0 or redis.call('HSETNX', reply, index, result) == 0 then
    return 0
  end
  local fields = redis.call('HMGET', reply, 'n', 'ch')
  if redis.call('HLEN', reply) == tonumber(fields[1]) + REPLY_META_FIELDS then
    redis.call('SPUBLISH', fields[2], request_id)
  end
  return 1
end
