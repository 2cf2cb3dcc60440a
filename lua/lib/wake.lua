-- lib/wake.lua: wake one idle worker, not the whole idle fleet.
-- An idle worker adds its owner id to the queue's `idle` SET before it waits (tokq.queue.shard
-- mark_idle) and listens on its owner channel (owner prefix .. owner id). A registered owner
-- with no listener is dead: the next one is tried. Returns 1 if a worker was told, else 0
-- (then `broadcast`, if given, goes to every listener of the work channel).
-- `message` (default 'work'): 'light' tells a worker running a heavy forward (registered in
-- the queue's `preemptible` SET instead of `idle`) that light work waits: it claims it
-- light-only and runs it nested (workers/preempt.py).

local function wake_one(idle, owner_prefix, broadcast, message)
  while true do
    local owner = redis.call('SPOP', idle)
    if not owner then
      if broadcast then
        redis.call('SPUBLISH', broadcast, '1')
      end
      return 0
    end
    if redis.call('SPUBLISH', owner_prefix .. owner, message or 'work') > 0 then
      return 1
    end
  end
end
