-- collect.lua: take a request's reply, atomically, in a way that is safe to run again.
-- KEYS[1] reply      HASH reply:<request_id>: n, ch, t and one field per answered item index
-- KEYS[2] collected  HASH collected:<request_id>: the same hash, kept for a repeat
-- ARGV[1] grace_ms: how long a collected reply is kept for a repeat after a lost answer
-- Renamed, not deleted: gone for every other script, yet a repeated collect after a lost
-- answer gets the same fields until grace_ms passes.
-- Returns the hash as a flat field/value list (empty if neither exists).

local fields = redis.call('HGETALL', KEYS[1])
if #fields > 0 then
  redis.call('RENAME', KEYS[1], KEYS[2])
  redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[1]))
  return fields
end
return redis.call('HGETALL', KEYS[2])
