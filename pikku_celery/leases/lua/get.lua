-- GET: read the live lease on a key.
-- KEYS[1]  lease hash
-- (no ARGV)
-- returns  {holder, token, pttl_ms, server_now_ms}, or nil when absent or lapsed
--#include now_ms
local held = redis.call('HMGET', KEYS[1], 'holder', 'token')
local pttl = redis.call('PTTL', KEYS[1])
if not held[1] or not held[2] or pttl <= 0 then
  return nil
end
return {held[1], held[2], pttl, now_ms}
