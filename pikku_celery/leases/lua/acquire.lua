-- ACQUIRE: grant a lease unless another holder's lease is live.
-- KEYS[1]  lease hash {holder, token}; exists only while the lease is live
-- KEYS[2]  token counter; INCR-ed on every fresh grant, never deleted
-- ARGV[1]  holder
-- ARGV[2]  ttl_ms
-- ARGV[3]  counter_ttl_ms: the counter expires this long after the last grant or renewal
-- returns  {token, server_now_ms}, or nil when another holder's lease is live
--#include now_ms
local current = redis.call('HGET', KEYS[1], 'holder')
if current and current ~= ARGV[1] then
  return nil
end
--#include grant
return {token, now_ms}
