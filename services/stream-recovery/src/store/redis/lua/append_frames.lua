-- Appends frames fenced by the token, idempotent by sequence, charged to the stream's
-- byte budget, trimmed to the buffer's length and to frames younger than the buffer ttl
-- (what an org's buffer bound counts); with resync, a batch that starts past the
-- next sequence restarts the buffer instead of answering a gap.
-- KEYS: lease, meta, frames, times.
-- ARGV: token, now ms, max frames, stream byte budget, buffer ttl ms, lease ttl ms,
--   resync ('1' or '0'), the changes channel, the run id, then (sequence, data) pairs
--   from ARGV[10].
-- Reply: {'ok', next sequence, frames stored, stream bytes left, bytes added} |
--   {'gap', next sequence} | {'budget'} | {'fenced'}.
local holder = redis.call('HGET', KEYS[1], 'token')
if holder and holder ~= ARGV[1] then return {'fenced'} end
local now = ARGV[2]
local max_frames = tonumber(ARGV[3])
local budget = tonumber(ARGV[4])
local ttl = ARGV[5]
local lease_ttl = tonumber(ARGV[6])
local resync = ARGV[7] == '1'
local A = 10
local m = redis.call('HMGET', KEYS[2], 'next', 'first', 'bytes')
local next = tonumber(m[1] or '1')
local first = tonumber(m[2] or '1')
local bytes = tonumber(m[3] or '0')
local n = (#ARGV - A + 1) / 2
local from = tonumber(ARGV[A])
if from > next then
  if not resync then return {'gap', next} end
  -- The controller no longer holds the frames in between: the buffer restarts at its
  -- first frame, and readers get a replay_gap for what was lost.
  for s = first, next - 1 do
    redis.call('HDEL', KEYS[3], s)
    redis.call('HDEL', KEYS[4], s)
  end
  first, next = from, from
end
local add = 0
for i = 0, n - 1 do
  if tonumber(ARGV[A + 2 * i]) >= next then add = add + string.len(ARGV[A + 1 + 2 * i]) end
end
if bytes + add > budget then return {'budget'} end
if not holder then
  -- A lost lease key is no fence (see RENEW): the run's controller takes it back.
  redis.call('HSET', KEYS[1], 'controller', 'resynced', 'token', ARGV[1], 'expires', tonumber(now) + lease_ttl)
  redis.call('PEXPIRE', KEYS[1], lease_ttl * 4)
  redis.call('HSET', KEYS[2], 'granted', '1')
end
local stored = 0
local data, times = {}, {}
for i = 0, n - 1 do
  if tonumber(ARGV[A + 2 * i]) == next then
    data[#data + 1] = next
    data[#data + 1] = ARGV[A + 1 + 2 * i]
    times[#times + 1] = next
    times[#times + 1] = now
    next = next + 1
    stored = stored + 1
  end
end
if stored > 0 then
  redis.call('HSET', KEYS[3], unpack(data))
  redis.call('HSET', KEYS[4], unpack(times))
end
-- Trimmed in chunks: unpack() is bounded by Lua's stack (a lowered max_frames can trim
-- many at once).
while next - first > max_frames do
  local trimmed = {}
  while next - first > max_frames and #trimmed < 1000 do
    trimmed[#trimmed + 1] = first
    first = first + 1
  end
  redis.call('HDEL', KEYS[3], unpack(trimmed))
  redis.call('HDEL', KEYS[4], unpack(trimmed))
end
-- Frames appended longer than the ttl ago go too (a stream that keeps appending keeps
-- its keys alive, never its old frames).
local oldest = tonumber(now) - tonumber(ttl)
while first < next do
  local at = redis.call('HGET', KEYS[4], first)
  if not at or tonumber(at) >= oldest then break end
  redis.call('HDEL', KEYS[3], first)
  redis.call('HDEL', KEYS[4], first)
  first = first + 1
end
redis.call('HSET', KEYS[2], 'next', next, 'first', first, 'bytes', bytes + add)
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('PEXPIRE', KEYS[3], ttl)
redis.call('PEXPIRE', KEYS[4], ttl)
-- Followers on every replica wake for new frames (ARGV[8] the channel, ARGV[9] the run).
if stored > 0 then redis.call('PUBLISH', ARGV[8], ARGV[9]) end
return {'ok', next, stored, budget - bytes - add, add}
