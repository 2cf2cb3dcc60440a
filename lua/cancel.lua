-- cancel.lua: withdraw a request: its reply key goes, and so do its entries still queued.
-- KEYS[1] pending  LIST   entries, head = oldest
-- KEYS[2] tokens   STRING sum of the tokens in pending
-- KEYS[3] reply    HASH   reply:<request_id>
-- ARGV[1..] the request's entries exactly as enqueued (rebuilt by tokq.entry.format_entry)
-- Entries already claimed, or requeued with another attempt count, are not found here; with
-- the reply key gone, claim and requeue drop them and ack writes nothing for them.
-- Returns the number of entries removed from pending.
--#include lib/common.lua
--#include lib/entry.lua

redis.call('DEL', KEYS[3])
local num_removed, removed_tokens = 0, 0
for i = 1, #ARGV do
  if redis.call('LREM', KEYS[1], 1, ARGV[i]) == 1 then
    num_removed = num_removed + 1
    removed_tokens = removed_tokens + parse_entry(ARGV[i])
  end
end
add_to_count(KEYS[2], -removed_tokens)
return num_removed
