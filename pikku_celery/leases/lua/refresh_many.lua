-- REFRESH_MANY: extend every lease whose holder and token still match, in one call, and
-- push back the expiry of its token counter.
-- KEYS[2i-1]   lease hash of lease i (i = 1..n)
-- KEYS[2i]     token counter of lease i
-- ARGV[4i-3]   holder of lease i
-- ARGV[4i-2]   token of lease i
-- ARGV[4i-1]   ttl_ms for lease i
-- ARGV[4i]     counter_ttl_ms for lease i
-- returns      {server_now_ms, flag_1, ..., flag_n}; flag 1 = extended, 0 = refused
--#include now_ms
local out = {now_ms}
for i = 1, #KEYS / 2 do
  local held = redis.call('HMGET', KEYS[2 * i - 1], 'holder', 'token')
  local flag = 0
  if held[1] == ARGV[4 * i - 3] and held[2] == ARGV[4 * i - 2] then
    redis.call('PEXPIRE', KEYS[2 * i - 1], math.max(1, tonumber(ARGV[4 * i - 1])))
    redis.call('PEXPIRE', KEYS[2 * i], tonumber(ARGV[4 * i]))
    flag = 1
  end
  out[i + 1] = flag
end
return out
