-- renew.lua: extend a running batch's lease.
-- KEYS[1] leases  ZSET batch_id -> lease deadline (ms)
-- ARGV[1] now_ms override ("" or 0 = Redis TIME)
-- ARGV[2] lease_ms: the new deadline is now_ms + lease_ms
-- ARGV[3] batch_id
-- Returns 1 if the lease still existed, 0 if it was already requeued or acknowledged.
--#include lib/common.lua

if not redis.call('ZSCORE', KEYS[1], ARGV[3]) then
  return 0
end
redis.call('ZADD', KEYS[1], 'XX', now_ms(ARGV[1]) + tonumber(ARGV[2]), ARGV[3])
return 1
