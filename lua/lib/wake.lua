-- lib/wake.lua: wake one idle worker, not the whole idle fleet.
-- An idle worker adds its batch prefix to the queue's `idle` SET before it waits (tokq.queue.shard
-- mark_idle) and listens on its worker channel (channel prefix .. batch prefix). A registered
-- worker with no listener is dead: the next one is tried. Returns 1 if a worker was told, else 0
-- (then `broadcast`, if given, goes to every listener of the work channel).
-- `message` (default 'work'): 'light' tells a worker running a heavy forward (registered in
-- the queue's `preemptible` SET instead of `idle`) that light work waits: it claims it
-- light-only and runs it nested (workers/preempt.py).

local function wake_one(idle, worker_channel_prefix, broadcast, message)
  while true do
    local worker = redis.call('SPOP', idle)
    if not worker then
      if broadcast then
        redis.call('SPUBLISH', broadcast, '1')
      end
      return 0
    end
    if redis.call('SPUBLISH', worker_channel_prefix .. worker, message or 'work') > 0 then
      return 1
    end
  end
end
