-- collect.lua: take a request's reply, atomically, in a way that is safe to run again.
-- KEYS[1] reply      HASH reply:<request_id>: n, ch, t and one field per answered item index
-- KEYS[2] collected  HASH collected:<request_id>: the same hash, kept for a repeat
-- ARGV[1] grace_ms: how long a collected reply is kept for a repeat after a lost answer
-- The reply is renamed, not deleted: from then on it is gone for every other script (a late
-- ack or a redo writes nothing, a claim drops leftovers as orphans), yet a client that lost
-- the answer and runs collect again gets the same fields. The copy expires after grace_ms.
-- Returns the hash as a flat field/value list (empty if neither exists).

local fields = redis.call('HGETALL', KEYS[1])
if #fields > 0 then
  redis.call('RENAME', KEYS[1], KEYS[2])
  redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[1]))
  return fields
end
return redis.call('HGETALL', KEYS[2])
