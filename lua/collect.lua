-- collect.lua: read and delete a request's reply, atomically.
-- KEYS[1] reply  HASH reply:<request_id>: n, ch and one field per answered item index
-- Returns the hash as a flat field/value list (empty if it does not exist).

local fields = redis.call('HGETALL', KEYS[1])
redis.call('DEL', KEYS[1])
return fields
