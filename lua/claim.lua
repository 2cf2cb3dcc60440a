-- claim.lua: take the next batch, up to a token budget, in one round trip.
-- KEYS[1] pending   LIST   light lane: entries of small requests, head = oldest
-- KEYS[2] tokens    STRING sum of the tokens in every lane
-- KEYS[3] leases    ZSET   batch_id -> lease deadline (ms)
-- KEYS[4] inflight  STRING claimed, unacknowledged items
-- KEYS[5] counters  HASH   claimed, batches, expired, orphaned
-- KEYS[6] heavy     LIST   heavy lane: larger requests' entries and redone items
-- KEYS[7] idle      SET    batch prefixes of idle workers (lib/wake.lua)
-- KEYS[8] batch     LIST   batch lane: batch-class entries, redone ones included
-- KEYS[9] batch_tokens STRING sum of the tokens in the batch lane
-- KEYS[10] lease_batch_counts HASH batch_id -> batch-lane entries of its lease (the last ones)
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
-- ARGV[11] worker channel prefix: a claim that leaves work queued wakes one more idle worker
-- ARGV[12] lanes: "light" = a pre-empting claim (a worker in a heavy forward runs it nested,
--          workers/preempt.py): the whole light lane if it fits token_budget, else nothing;
--          "heavy" = the next batch of a worker in a heavy forward: the heavy lane only while
--          the light lane holds at most ARGV[13] tokens, else the light lane first (the whole
--          budget) and heavy work that fits; "" or "both" = the usual claim
-- ARGV[13] preempt_tokens: the light-only claims' budget ("" or 0: a "heavy" claim never reads
--          the light lane)
-- ARGV[14] batch_share_tokens: tokens a starving batch lane takes first (claim_rule.batch_share_tokens)
-- ARGV[15] batch_starve_ms: the batch lane starves once its head has waited this long
-- ARGV[16] after_isolated: "1" = this worker's last full claim on this shard took a redo to
--          isolate: no isolated head (heavy, or starving batch) goes first; the lanes are read
--          by the rule and the redo ends the batch, alone the claim after ("" or "0": as usual)
-- ARGV[17] bulk_forward: "1" = a "light" claim nested in a batch-class forward
--          (claim_rule.is_bulk_batch): it takes what fits token_budget from the light lane's
--          head, as a usual scan, rather than refuse a longer lane ("" or "0": as usual)
-- "both" and "heavy" claims read the batch lane after the interactive lanes (the room they
-- leave), or first within its share when it starves; "light" claims never read it.
-- The rule is tokq/queue/claim_rule.py, entry for entry. Returns
--   {batch_id or '', now_ms, num_expired, num_orphaned, {taken entries}, num_heavy, stop, num_batch}
-- Taken entries: light lane's, then heavy lane's, then batch lane's.
-- num_heavy, num_batch: how many of the taken entries came from the heavy and batch lanes; -1
-- on a repeat (unknown): a worker pre-empts only a forward holding heavy or batch-class work
-- (workers/preempt.py)
-- stop: why the batch stopped growing (claim_rule.STOP_REASONS); '' on a repeat
--#include lib/common.lua
--#include lib/entry.lua
--#include lib/reply.lua
--#include lib/wake.lua

local pending, leases, counters, heavy, batch = KEYS[1], KEYS[3], KEYS[5], KEYS[6], KEYS[8]
local now = now_ms(ARGV[1])
local batch_id, lease = ARGV[9], ARGV[8] .. ARGV[9]
if redis.call('ZSCORE', leases, batch_id) then
  return {batch_id, now, 0, 0, redis.call('LRANGE', lease, 0, -1), -1, '', -1} -- a repeat
end
local token_budget = tonumber(ARGV[2])
local lookahead = tonumber(ARGV[4])
local max_skip_age_ms = tonumber(ARGV[5])
local max_drop = tonumber(ARGV[6])
local reply_prefix = ARGV[7]
local isolate_attempt = tonumber(ARGV[10])
local lanes = ARGV[12]
local preempt_tokens = tonumber(ARGV[13]) or 0
local batch_share_tokens = tonumber(ARGV[14]) or 0
local batch_starve_ms = tonumber(ARGV[15]) or 0
local after_isolated = ARGV[16] == '1'
local bulk_forward = ARGV[17] == '1'
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

local window_size = math.min(math.max(math.floor(token_budget / 8), 16), 512)

-- The lane holds more than `limit` tokens, dead entries included (claim_rule.lane_exceeds).
local function lane_exceeds(lane, limit)
  local total, offset = 0, 0
  while true do
    local window = redis.call('LRANGE', lane, offset, offset + window_size - 1)
    for i = 1, #window do
      total = total + tonumber(match(window[i], '^(%d+)::'))
      if total > limit then
        return true
      end
    end
    if #window < window_size then
      return false
    end
    offset = offset + #window
  end
end

-- Scan phase: read a lane's head in windows, decide each entry; nothing is written yet.
local light_taken, heavy_taken, batch_taken, taken_tokens = {}, {}, {}, 0
local expired, num_orphaned, dropped_tokens = {}, 0, 0
local batch_lane_tokens = 0 -- taken or dropped from the batch lane
local done = false -- an isolated item was taken, or max_drop reached: the claim ends
local ITEM_STOP = {light = 'full', heavy = 'heavy_item', batch = 'batch_item'}

-- Takes from `lane` (of `kind`: light, heavy, batch) within `share` tokens in all (its first
-- live item always while lane_taken is 0), reading the entries of `prefix` (passed over by an
-- earlier scan) first, then the lane from index `start`. Returns the entries passed over, the
-- entries consumed (prefix and lane), why it stopped, and lane_taken.
local function scan(lane, share, kind, lane_taken, prefix, start)
  local taken = kind == 'heavy' and heavy_taken or (kind == 'batch' and batch_taken or light_taken)
  local in_batch = kind == 'batch'
  local skipped, consumed = {}, 0
  -- One entry: nil to go on, else why the scan stops.
  local function visit(raw)
    local tokens, ts_ms, request_id, index, deadline_ms, attempt = parse_entry(raw)
    if deadline_ms <= now then
      expired[#expired + 1] = {request_id, index}
      dropped_tokens = dropped_tokens + tokens
      if in_batch then batch_lane_tokens = batch_lane_tokens + tokens end
    elseif not is_live(request_id) then
      num_orphaned = num_orphaned + 1
      dropped_tokens = dropped_tokens + tokens
      if in_batch then batch_lane_tokens = batch_lane_tokens + tokens end
    elseif (#light_taken + #heavy_taken + #batch_taken) > 0 and attempt ~= '0'
        and tonumber(attempt) >= isolate_attempt then
      return 'isolated' -- an item that failed repeatedly goes alone (below): it ends this batch
    elseif lane_taken == 0 or taken_tokens + tokens <= share then
      taken[#taken + 1] = raw
      lane_taken = lane_taken + 1
      taken_tokens = taken_tokens + tokens
      if in_batch then batch_lane_tokens = batch_lane_tokens + tokens end
      if attempt ~= '0' and tonumber(attempt) >= isolate_attempt then
        -- Alone, so a poison item cannot use up its batch-mates' attempts with its own.
        consumed = consumed + 1
        done = true
        return 'isolated'
      end
    elseif #skipped >= lookahead or (not in_batch and now - tonumber(ts_ms) >= max_skip_age_ms) then
      -- lookahead 0: nothing is ever passed over (strict FIFO); batch entries at any age
      if lookahead > 0 and #skipped >= lookahead then
        return 'lookahead'
      end
      return ITEM_STOP[kind]
    else
      skipped[#skipped + 1] = raw
    end
    consumed = consumed + 1
    if #expired + num_orphaned >= max_drop then
      done = true
      return 'dropped'
    end
    if lane_taken > 0 and taken_tokens >= share then
      return 'full'
    end
    return nil
  end
  for i = 1, #prefix do
    local stop = visit(prefix[i])
    if stop then
      return skipped, consumed, stop, lane_taken
    end
  end
  local offset = start
  while true do
    local window = redis.call('LRANGE', lane, offset, offset + window_size - 1)
    for i = 1, #window do
      local stop = visit(window[i])
      if stop then
        return skipped, consumed, stop, lane_taken
      end
    end
    if #window < window_size then -- the lane's end; entries passed over did not fit
      if #skipped > 0 then
        return skipped, consumed, ITEM_STOP[kind], lane_taken
      end
      return skipped, consumed, 'dry', lane_taken
    end
    offset = offset + #window
  end
end

local light_skipped, light_scanned, heavy_skipped, heavy_scanned = {}, 0, {}, 0
local batch_skipped, batch_scanned = {}, 0
local stop = 'dry'
local refused = false
if lanes == 'light' then
  local backlog = lane_exceeds(pending, token_budget)
  if backlog and not bulk_forward then
    refused = true -- a backlog: left to full batches
  else -- in a batch-class forward, a longer lane gives what fits
    light_skipped, light_scanned, stop = scan(pending, token_budget, 'light', 0, {}, 0)
    if #light_taken > 0 and not backlog then
      stop = 'preempt'
    end
  end
else
  -- the heads by LINDEX: an empty queue costs no LRANGE (idle workers claim often)
  local heavy_head, batch_head = redis.call('LINDEX', heavy, 0), redis.call('LINDEX', batch, 0)
  local heavy_isolated, starving, batch_alone = false, false, false
  local head_tokens = 0
  if heavy_head then
    local tokens, _, _, _, _, head_attempt = parse_entry(heavy_head)
    head_tokens, heavy_isolated = tokens, tonumber(head_attempt) >= isolate_attempt
  end
  if batch_head then
    local _, head_ts, _, _, _, head_attempt = parse_entry(batch_head)
    starving = now - tonumber(head_ts) >= batch_starve_ms
    -- A starving redo to isolate goes alone, before interactive work (a heavy one first); not
    -- after_isolated: light work goes first, the redo the claim after.
    batch_alone = starving and tonumber(head_attempt) >= isolate_attempt and not heavy_isolated
      and not after_isolated
  end
  -- Interactive work's budget: all of it, or what a starving batch lane's share leaves.
  local room = token_budget
  if starving then
    room = math.max(0, token_budget - batch_share_tokens)
  end
  if batch_alone then
    -- interactive work waits: the redo goes alone (below)
  elseif lanes == 'heavy' and (preempt_tokens <= 0 or not lane_exceeds(pending, preempt_tokens)) then
    heavy_skipped, heavy_scanned, stop = scan(heavy, room, 'heavy', 0, {}, 0)
    if stop == 'dry' and redis.call('LLEN', pending) > 0 then
      stop = 'heavy_only'
    end
  elseif lanes == 'heavy' then -- a light backlog: light first, all of the budget; heavy work that fits
    light_skipped, light_scanned, stop = scan(pending, room, 'light', 0, {}, 0)
    if not done and taken_tokens < room and heavy_head then
      heavy_skipped, heavy_scanned, stop = scan(heavy, room, 'heavy', 1, {}, 0)
    end
  else
    -- The light lane first, within its share (claim_rule.light_share); not at all when the heavy
    -- lane's head is a redo to isolate (it goes alone now), unless after_isolated.
    local share, capped, num_light = room, false, 0
    if heavy_head then
      share = math.max(0, math.min(math.floor(room / 2), room - head_tokens))
    end
    if not heavy_isolated or after_isolated then
      light_skipped, light_scanned, stop, num_light = scan(pending, share, 'light', 0, {}, 0)
      capped = share < room and (stop == 'full' or stop == 'lookahead') -- stopped by its share
    end
    if heavy_head and not done then
      heavy_skipped, heavy_scanned, stop = scan(heavy, room, 'heavy', 0, {}, 0)
    end
    if capped and not done and taken_tokens < room then
      -- The room the heavy lane left goes to the light lane: entries passed over first.
      local skipped, consumed
      skipped, consumed, stop = scan(pending, room, 'light', num_light, light_skipped, light_scanned)
      for i = consumed + 1, #light_skipped do
        skipped[#skipped + 1] = light_skipped[i] -- passed over before, not reached this time
      end
      light_scanned = light_scanned + math.max(0, consumed - #light_skipped)
      light_skipped = skipped
    end
  end
  if batch_head and not done and (starving or taken_tokens < token_budget) then
    -- Batch work: its head whenever starving or nothing else was taken, then what fits.
    local forced = starving or (#light_taken + #heavy_taken) == 0
    batch_skipped, batch_scanned, stop = scan(batch, token_budget, 'batch', forced and 0 or 1, {}, 0)
  end
end
local num_heavy, num_batch = #heavy_taken, #batch_taken
local taken = light_taken
for i = 1, #heavy_taken do
  taken[#taken + 1] = heavy_taken[i]
end
for i = 1, #batch_taken do
  taken[#taken + 1] = batch_taken[i]
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
if batch_scanned > 0 then
  redis.call('LTRIM', batch, batch_scanned, -1)
  push_front(batch, batch_skipped)
end
add_to_count(KEYS[2], -(taken_tokens + dropped_tokens))
add_to_count(KEYS[9], -batch_lane_tokens)
add_to_counter(counters, 'expired', #expired)
add_to_counter(counters, 'orphaned', num_orphaned)
if #taken == 0 then
  return {'', now, #expired, num_orphaned, {}, 0, refused and 'backlog' or stop, 0}
end
push_values('RPUSH', lease, taken)
redis.call('ZADD', leases, now + tonumber(ARGV[3]), batch_id)
if num_batch > 0 then
  redis.call('HSET', KEYS[10], batch_id, num_batch) -- a redo puts them back in the batch lane
end
add_to_count(KEYS[4], #taken)
add_to_counter(counters, 'claimed', #taken)
add_to_counter(counters, 'batches', 1)
if redis.call('EXISTS', KEYS[2]) == 1 then
  wake_one(KEYS[7], ARGV[11], nil) -- work left: the next idle worker (a burst spreads)
end
return {batch_id, now, #expired, num_orphaned, taken, num_heavy, stop, num_batch}
