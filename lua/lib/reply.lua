-- lib/reply.lua: writing one item's result into its request's reply HASH, and the completion
-- notices of the requests a script completed.
-- The hash holds `n` (item count), `ch` (the gateway's notice channel, a shard channel),
-- `t` ("ts_ms:deadline_ms", for a repeated enqueue) and one field per answered item index.
-- The first result for an index wins (HSETNX), so a redone or late ack is never seen twice;
-- the write that completes the request adds its notice to ``notices``, and
-- ``publish_notices`` SPUBLISHes them at the end of the script, one message per notice
-- channel carrying every request of that gateway the script completed (a batch's replies wake
-- a gateway once, not once per request). The channel carries the queue's hash tag, so on
-- Redis Cluster the notice stays on the queue's node. A reply hash that no longer exists
-- (collected, cancelled or expired) gets nothing: a late ack must not resurrect it.
local REPLY_META_FIELDS = 3 -- n, ch, t (tokq.queue.shard.REPLY_META_FIELDS)
-- A complete reply up to this many bytes of results travels in its notice, so the gateway
-- needs no collect round trip (tokq.queue.shard.parse_notices). Bigger ones notify by id only; and a
-- message holds at most this many bytes of results: a slow gateway's pub/sub output buffer must
-- not fill up (Redis drops a subscriber past its limit).
local MAX_NOTICE_BYTES = 65536
-- A reply delivered in its notice is kept this long more, no longer, for a gateway that missed
-- the notice: its poll finds the reply complete within ~1 s and collects it. Also the grace of
-- a collected reply (tokq.queue.shard.COLLECT_GRACE_MS).
local DELIVERED_TTL_MS = 5000

-- One request's notice: "<request_id>\0" then "<index>:<length>:<result bytes>" per item, or
-- "<request_id>" alone when the results are too big to carry; and the bytes of results it holds.
local function reply_notice(reply, request_id)
  local fields = redis.call('HGETALL', reply)
  local parts, size = {request_id, '\0'}, 0
  for i = 1, #fields, 2 do
    local field = fields[i]
    if field ~= 'n' and field ~= 'ch' and field ~= 't' then
      local value = fields[i + 1]
      size = size + #value
      parts[#parts + 1] = field .. ':' .. #value .. ':'
      parts[#parts + 1] = value
    end
  end
  if size > MAX_NOTICE_BYTES then
    return request_id, 0
  end
  redis.call('PEXPIRE', reply, DELIVERED_TTL_MS, 'LT')
  return table.concat(parts), size
end

-- A message: one or more "<length>:<notice>" records (tokq.queue.shard.parse_notices).
local function publish_message(notice_channel, pending)
  redis.call('SPUBLISH', notice_channel, table.concat(pending.parts))
end

-- ``notices`` (a script's own, {} at its start): notice channel -> {parts, size}, and the channels in
-- the order they first completed a request.
local function add_notice(notices, notice_channel, notice, size)
  local record = #notice .. ':' .. notice
  local pending = notices[notice_channel]
  if pending == nil then
    pending = {parts = {}, size = 0}
    notices[notice_channel] = pending
    notices[#notices + 1] = notice_channel -- publish in the order channels first completed
  elseif pending.size + size > MAX_NOTICE_BYTES then
    publish_message(notice_channel, pending)
    pending.parts, pending.size = {}, 0
  end
  pending.parts[#pending.parts + 1] = record
  pending.size = pending.size + size
end

local function publish_notices(notices)
  for _, notice_channel in ipairs(notices) do
    local pending = notices[notice_channel]
    if #pending.parts > 0 then
      publish_message(notice_channel, pending)
    end
  end
end

-- Returns 1 when a new result was stored, else 0.
local function write_result(reply_prefix, request_id, index, result, notices)
  local reply = reply_prefix .. request_id
  if redis.call('EXISTS', reply) == 0 or redis.call('HSETNX', reply, index, result) == 0 then
    return 0
  end
  local fields = redis.call('HMGET', reply, 'n', 'ch')
  if redis.call('HLEN', reply) == tonumber(fields[1]) + REPLY_META_FIELDS then
    add_notice(notices, fields[2], reply_notice(reply, request_id))
  end
  return 1
end
