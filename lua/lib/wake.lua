-- lib/wake.lua: wake one idle worker, not the whole idle fleet.
-- An idle worker adds its owner id to the queue's `idle` SET before it waits (tokq.queue
-- mark_idle) and listens on its owner channel (owner prefix .. owner id). A registered owner
-- with no listener is dead: the next one is tried. Returns 1 if a worker was told, else 0
-- (then `broadcast`, if given, goes to every listener of the work channel).

local function wake_one(idle, owner_prefix, broadcast)
  while true do
    local owner = redis.call('SPOP', idle)
    if not owner then
      if broadcast then
        redis.call('SPUBLISH', broadcast, '1')
      end
      return 0
    end
    if redis.call('SPUBLISH', owner_prefix .. owner, 'work') > 0 then
      return 1
    end
  end
end
