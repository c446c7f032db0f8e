-- Shared by the granting scripts (included with --#include grant): KEYS[1] hash, KEYS[2]
-- counter, ARGV[1] holder, ARGV[2] ttl, ARGV[3] counter ttl; ``current`` is the live holder
-- or false. Keep the live holder's token, else take the next one, then push both expiries
-- back.
local token
if current then
  token = tonumber(redis.call('HGET', KEYS[1], 'token'))
else
  token = redis.call('INCR', KEYS[2])
  redis.call('HSET', KEYS[1], 'holder', ARGV[1], 'token', string.format('%d', token))
end
redis.call('PEXPIRE', KEYS[1], math.max(1, tonumber(ARGV[2])))
redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[3]))
