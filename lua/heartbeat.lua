-- heartbeat.lua: record that a worker is alive, on the Redis clock (one clock for every host).
-- KEYS[1] workers    ZSET   worker_id -> last heartbeat (ms)
-- KEYS[2] heartbeat  STRING heartbeat:<worker_id>: the worker's JSON status, expires after ttl
-- ARGV[1] now_ms override ("" or 0 = Redis TIME)
-- ARGV[2] worker_id
-- ARGV[3] status: a JSON object; ts_ms (the Redis clock) is added here
-- ARGV[4] ttl_ms: the heartbeat key lives this long unless beaten again
-- ARGV[5] forget_after_ms: registry members silent this long are removed (crashed workers)
-- Idempotent: a repeat writes the same (a newer now at most). Returns now_ms.
--#include lib/common.lua

local now = now_ms(ARGV[1])
local status = cjson.decode(ARGV[3])
status['ts_ms'] = now
redis.call('SET', KEYS[2], cjson.encode(status), 'PX', tonumber(ARGV[4]))
redis.call('ZADD', KEYS[1], now, ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[5]))
return now
