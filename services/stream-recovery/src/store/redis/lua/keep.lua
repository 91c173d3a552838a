-- keep(key, ms): the key, if it exists, lives at least `ms` more (never shortened).
-- Prepended to the scripts that call it.
local function keep(key, ms)
  local t = redis.call('PTTL', key)
  if t == -1 or (t >= 0 and t < ms) then redis.call('PEXPIRE', key, ms) end
end
