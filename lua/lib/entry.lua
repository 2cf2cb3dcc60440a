-- lib/entry.lua: the text head of a queue entry (the format of tokq/queue/wire.py):
--   <tokens>::<ts_ms>::<request_id>:<index>:<deadline_ms>:<attempt>:<body>
-- Only the head is parsed; the body is opaque binary and may hold any byte, ':' included.

local ENTRY_HEAD = '^(%d+)::(%d+)::([^:]+):(%d+):(%d+):(%d+):'
local match, tonumber = string.match, tonumber -- locals: the claim loop calls these per entry

-- Returns tokens and deadline_ms as numbers, ts_ms, request_id, index and attempt as strings:
-- parsing is most of a claim's cost, and most entries never need the other numbers.
local function parse_entry(raw)
  local tokens, ts_ms, request_id, index, deadline_ms, attempt = match(raw, ENTRY_HEAD)
  if not tokens then
    error('tokq: malformed queue entry ' .. string.sub(raw, 1, 48))
  end
  return tonumber(tokens), ts_ms, request_id, index, tonumber(deadline_ms), attempt
end

local function format_entry(tokens, ts_ms, request_id, index, deadline_ms, attempt, body)
  return string.format('%d::%d::%s:%d:%d:%d:', tokens, ts_ms, request_id, index, deadline_ms, attempt)
    .. body
end

-- The same entry with another attempt count.
local function with_attempt(raw, attempt)
  local head, body_at = match(raw, '^(%d+::%d+::[^:]+:%d+:%d+:)%d+:()')
  return head .. string.format('%d:', attempt) .. string.sub(raw, body_at)
end
