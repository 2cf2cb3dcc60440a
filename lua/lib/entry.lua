-- lib/entry.lua: the text head of a queue entry (the format of tokq/entry.py):
--   <tokens>::<ts_ms>::<request_id>:<index>:<deadline_ms>:<attempt>:<body>
-- Only the head is parsed; the body is opaque binary and may hold any byte, ':' included.

local ENTRY_HEAD = '^(%d+)::(%d+)::([^:]+):(%d+):(%d+):(%d+):()'

-- Returns tokens, ts_ms, request_id, index (string), deadline_ms, attempt, body offset.
local function parse_entry(raw)
  local tokens, ts_ms, request_id, index, deadline_ms, attempt, body_at = string.match(raw, ENTRY_HEAD)
  if not tokens then
    error('tokq: malformed queue entry ' .. string.sub(raw, 1, 48))
  end
  return tonumber(tokens), tonumber(ts_ms), request_id, index, tonumber(deadline_ms),
    tonumber(attempt), body_at
end

local function format_entry(tokens, ts_ms, request_id, index, deadline_ms, attempt, body)
  return string.format('%d::%d::%s:%d:%d:%d:', tokens, ts_ms, request_id, index, deadline_ms, attempt)
    .. body
end

-- The same entry with another attempt count.
local function with_attempt(raw, attempt)
  local tokens, ts_ms, request_id, index, deadline_ms, _, body_at = parse_entry(raw)
  return format_entry(tokens, ts_ms, request_id, index, deadline_ms, attempt, string.sub(raw, body_at))
end
