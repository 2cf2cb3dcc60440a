-- claim.lua: take the next batch, up to a token budget, in one round trip.
-- KEYS[1] pending   LIST   light lane: entries of small requests, head = oldest
-- KEYS[2] tokens    STRING sum of the tokens in both lanes
-- KEYS[3] leases    ZSET   batch_id -> lease deadline (ms)
-- KEYS[4] inflight  STRING claimed, unacknowledged items
-- KEYS[5] counters  HASH   claimed, batches, expired, orphaned
-- KEYS[6] heavy     LIST   heavy lane: larger requests' entries and redone items
-- KEYS[7] idle      SET    owner ids of idle workers (lib/wake.lua)
-- ARGV[1] now_ms override ("" or 0 = Redis TIME)
-- ARGV[2] token_budget: max summed tokens (a lane's first item still goes; see tokq/queue/claim_rule.py)
-- ARGV[3] lease_ms: how long the worker has before the batch is requeued
-- ARGV[4] lookahead: entries per lane that may be passed over to fill the budget (0 = strict FIFO)
-- ARGV[5] max_skip_age_ms: an entry this old is never passed over
-- ARGV[6] max_drop: stop after dropping this many expired/orphaned entries
-- ARGV[7] reply key prefix, ARGV[8] lease key prefix (same hash tag)
-- ARGV[9] batch id, chosen by the client (unique prefix + its own counter): a repeat of the
--         same claim after a lost answer finds the lease and gets the same batch back, instead
--         of leasing a second one that nobody would ever process
-- ARGV[10] isolate_attempt: an entry redone this many times or more is claimed alone
-- ARGV[11] owner channel prefix: a claim that leaves work queued wakes one more idle worker
-- ARGV[12] lanes: "light" = a pre-empting claim (a worker in a heavy forward runs it nested,
--          workers/preempt.py): light-lane entries only, up to all of token_budget; "heavy" =
--          the heavy lane only (the next batch of a worker in a heavy forward: light work that
--          arrives meanwhile goes to its light-only claims); "" or "both" = the usual claim
-- The rule is tokq/queue/claim_rule.py, entry for entry. Returns
--   {batch_id or '', now_ms, num_expired, num_orphaned, {taken entries}, num_heavy}
-- num_heavy: how many of the taken entries (the last ones) came from the heavy lane; -1 on a
-- repeat (unknown): a worker pre-empts only a forward holding heavy work (workers/preempt.py)
--#include lib/common.lua
--#include lib/entry.lua
--#include lib/reply.lua
--#include lib/wake.lua

local pending, leases, counters, heavy = KEYS[1], KEYS[3], KEYS[5], KEYS[6]
local now = now_ms(ARGV[1])
local batch_id, lease = ARGV[9], ARGV[8] .. ARGV[9]
if redis.call('ZSCORE', leases, batch_id) then
  return {batch_id, now, 0, 0, redis.call('LRANGE', lease, 0, -1), -1} -- a repeat
end
local token_budget = tonumber(ARGV[2])
local lookahead = tonumber(ARGV[4])
local max_skip_age_ms = tonumber(ARGV[5])
local max_drop = tonumber(ARGV[6])
local reply_prefix = ARGV[7]
local isolate_attempt = tonumber(ARGV[10])
local lanes = ARGV[12]
local light_only = lanes == 'light'
local EXPIRED = '-DEADLINE_EXCEEDED:deadline passed while queued'

-- One EXISTS per request, not per item: a request's items sit together.
local live = {}
local function is_live(request_id)
  local known = live[request_id]
  if known == nil then
    known = redis.call('EXISTS', reply_prefix .. request_id) == 1
    live[request_id] = known
  end
  return known
end

-- Scan phase: read a lane's head in windows, decide each entry; nothing is written yet.
local window_size = math.min(math.max(math.floor(token_budget / 8), 16), 512)
local taken, taken_tokens = {}, 0
local expired, num_orphaned, dropped_tokens = {}, 0, 0
local done = false -- an isolated item was taken, or max_drop reached: the claim ends

-- Takes from `lane` up to `share` tokens in all (its first live item always); returns the
-- entries passed over and the number of head entries consumed.
local function scan(lane, share)
  local skipped, lane_taken, num_scanned, stopped = {}, 0, 0, false
  while not stopped do
    local window = redis.call('LRANGE', lane, num_scanned, num_scanned + window_size - 1)
    for i = 1, #window do
      local raw = window[i]
      local tokens, ts_ms, request_id, index, deadline_ms, attempt = parse_entry(raw)
      if deadline_ms <= now then
        expired[#expired + 1] = {request_id, index}
        dropped_tokens = dropped_tokens + tokens
      elseif not is_live(request_id) then
        num_orphaned = num_orphaned + 1
        dropped_tokens = dropped_tokens + tokens
      elseif #taken > 0 and attempt ~= '0' and tonumber(attempt) >= isolate_attempt then
        stopped = true -- an item that failed repeatedly goes alone (below): it ends this batch
        break
      elseif lane_taken == 0 or taken_tokens + tokens <= share then
        taken[#taken + 1] = raw
        lane_taken = lane_taken + 1
        taken_tokens = taken_tokens + tokens
        if attempt ~= '0' and tonumber(attempt) >= isolate_attempt then
          -- Alone, so a poison item cannot use up its batch-mates' attempts with its own.
          num_scanned = num_scanned + 1
          stopped, done = true, true
          break
        end
      elseif #skipped >= lookahead or now - tonumber(ts_ms) >= max_skip_age_ms then
        stopped = true -- lookahead 0: nothing is ever passed over (strict FIFO)
        break
      else
        skipped[#skipped + 1] = raw
      end
      num_scanned = num_scanned + 1
      if #expired + num_orphaned >= max_drop then
        stopped, done = true, true
        break
      end
      if lane_taken > 0 and taken_tokens >= share then
        stopped = true
        break
      end
    end
    if #window < window_size then
      stopped = true
    end
  end
  return skipped, num_scanned
end

-- The light lane first, within its share (tokq.queue.claim_rule.light_share); not at all when the
-- heavy lane's head is a redo to isolate (it goes alone now).
local light_skipped, light_scanned, heavy_skipped, heavy_scanned = {}, 0, {}, 0
local heavy_head = (not light_only) and redis.call('LINDEX', heavy, 0)
local share = token_budget
local isolated_head = false
if heavy_head then
  local head_tokens, _, _, _, _, head_attempt = parse_entry(heavy_head)
  share = math.max(0, math.min(math.floor(token_budget / 2), token_budget - head_tokens))
  isolated_head = tonumber(head_attempt) >= isolate_attempt
end
if not isolated_head and lanes ~= 'heavy' then
  light_skipped, light_scanned = scan(pending, share)
end
local num_light = #taken
if heavy_head and not done then -- an empty heavy lane costs no LRANGE (idle workers claim often)
  heavy_skipped, heavy_scanned = scan(heavy, token_budget)
end

-- Write phase.
local notices = {} -- one message per waiting gateway (lib/reply.lua)
for _, item in ipairs(expired) do
  write_result(reply_prefix, item[1], item[2], EXPIRED, notices)
end
publish_notices(notices)
-- Drop each lane's scanned head, then put its passed-over entries back in front, in order.
if light_scanned > 0 then
  redis.call('LTRIM', pending, light_scanned, -1)
  push_front(pending, light_skipped)
end
if heavy_scanned > 0 then
  redis.call('LTRIM', heavy, heavy_scanned, -1)
  push_front(heavy, heavy_skipped)
end
add_to_count(KEYS[2], -(taken_tokens + dropped_tokens))
add_to_counter(counters, 'expired', #expired)
add_to_counter(counters, 'orphaned', num_orphaned)
if #taken == 0 then
  return {'', now, #expired, num_orphaned, {}, 0}
end
push_values('RPUSH', lease, taken)
redis.call('ZADD', leases, now + tonumber(ARGV[3]), batch_id)
add_to_count(KEYS[4], #taken)
add_to_counter(counters, 'claimed', #taken)
add_to_counter(counters, 'batches', 1)
if redis.call('EXISTS', KEYS[2]) == 1 then
  wake_one(KEYS[7], ARGV[11], nil) -- work left: the next idle worker (a burst spreads)
end
return {batch_id, now, #expired, num_orphaned, taken, #taken - num_light}
