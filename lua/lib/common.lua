-- lib/common.lua: clock and counter helpers shared by the queue scripts.
-- Times are milliseconds on the Redis clock, so every host agrees on "now".

-- ARGV override for tests ("" or "0" = use Redis TIME).
local function now_ms(override)
  local forced = tonumber(override)
  if forced and forced > 0 then
    return forced
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- INCRBY that deletes the key when it returns to zero, so a drained queue leaves no
-- "0" strings behind; a negative value (a bug) stays visible.
local function add_to_count(key, delta)
  if delta ~= 0 and redis.call('INCRBY', key, delta) == 0 then
    redis.call('DEL', key)
  end
end

local function add_to_counter(counters, field, delta)
  if delta > 0 then
    redis.call('HINCRBY', counters, field, delta)
  end
end

-- RPUSH/LPUSH `values` in chunks: unpack() of thousands of values would
-- overflow Lua's C stack.
local PUSH_CHUNK = 1000
local function push_values(command, key, values)
  for first = 1, #values, PUSH_CHUNK do
    redis.call(command, key, unpack(values, first, math.min(first + PUSH_CHUNK - 1, #values)))
  end
end

-- Put `values` back at the head of a list in their given order.
local function push_front(key, values)
  local reversed = {}
  for i = #values, 1, -1 do
    reversed[#reversed + 1] = values[i]
  end
  push_values('LPUSH', key, reversed)
end
